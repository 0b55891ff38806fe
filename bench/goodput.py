"""Goodput under a fault schedule: the Transformer example on a cluster-in-a-box, faulted and not.

Two runs of the same job (same steps, seed and world size) on 3 hosts in network namespaces with a
3-member etcd and two coordinators (tests/cluster_box):

- a fault-free run, the baseline;
- a run where a seeded schedule injects one fault every `--every-s` seconds, rotating through: a
  worker crash (SIGKILL), a host cut off (link down, healed `--heal-after-s` later), a hung worker
  (SIGSTOP until the coordinator's hang detection stops the generation), the leading coordinator
  killed (restarted later), and an etcd member killed (restarted later).

It prints each run's goodput and its phases (trainerctl status -o json, `job.goodput`), every fault
with the generations it caused (resumed step, steps lost) and its ledger: the seconds it cost, split as
`last_recovery.cost_s` splits them (detect, stop, relaunch, comm_setup, compile, load, lost_work;
docs/concepts/recovery.md). The ledgers are summed per fault kind and in all, beside the goodput
difference they should account for (the faulted run's seconds not productive, less the fault-free
run's); what no recovery accounts for (a leader change without a relaunch) is the gap. Then how far
the final weights are from the fault-free run's: bit-identical when the world size never changed; a
run that shrank trained some steps with its micro-batches summed in another order. The cluster runs
at the product's default heartbeat settings. Needs root and iproute2.

    .venv/bin/python bench/goodput.py --steps 6000 --every-s 300     # the reported figure (~2 × 10 min)
    .venv/bin/python bench/goodput.py --steps 600 --every-s 40       # a quick look
    .venv/bin/python bench/goodput.py --memory-every 0               # without in-memory snapshots
    .venv/bin/python bench/goodput.py --faults host_cut --spares 1   # a host cut with a spare standing by
    .venv/bin/python bench/goodput.py --faults host_cut              # ... and without: the job shrinks

`--spares K` adds K hosts and sets job.spare_nodes K: the job still runs on 3 hosts, and a cut host is replaced
by a spare at the same world size (the healed host becomes the next spare); without, the job shrinks to 2 and
grows back once the host is healed. `--faults` limits the rotation to the kinds named.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from daemon.cli.status_json import COST_PARTS  # noqa: E402
from daemon.config import HeartbeatSettings  # noqa: E402
from tests.cluster_box.box import ClusterBox  # noqa: E402
from tests.ports import scheduler_port  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

FAULT_KINDS = ("worker_crash", "host_cut", "hang", "coordinator_kill", "etcd_member_loss")
HOSTS = 3
HANG_TIMEOUT_S = 20
# The faulted run's events are printed after its figures (what each fault set going, as the coordinator told
# it), but for these, one every checkpoint.
UNTOLD_EVENTS = frozenset({"checkpoint_saved"})
PHASES = ("productive_s", "lost_work_s", "detection_s", "relaunch_s", "startup_s", "checkpoint_stall_s",
          "waiting_s", "paused_s")


@dataclass
class Fault:
    kind: str
    at_s: float
    target: str
    step_before: int
    generation_before: int
    relaunches: list[dict] = field(default_factory=list)  # the generations it caused: resumed step, phases

    @property
    def lost_steps(self) -> int:
        return sum(r["lost_steps"] for r in self.relaunches)

    @property
    def cost_s(self) -> dict[str, float]:
        """The ledgers of the recoveries it caused, summed."""
        return {part: sum((r.get("cost_s") or {}).get(part, 0.0) for r in self.relaunches) for part in COST_PARTS}


def transformer_job(steps: int, out: Path, memory_every: int | str, spares: int):
    def build(box: ClusterBox) -> dict:
        return {
            "name": "lm",
            "entrypoint": ["{python}", "-m", "trainer.examples.transformer_lm", "--steps", str(steps),
                           "--steps-per-epoch", "100", "--log-every", "500", "--output", str(out)],
            "min_nodes": 2, "max_nodes": HOSTS, "spare_nodes": spares, "global_batch": 48, "micro_batch": 8,
            "scheduler_port": scheduler_port(), "stop_grace_s": 3, "start_wait_s": 60,
            "hang_timeout_s": HANG_TIMEOUT_S,
            "checkpoint": {"dir": str(box.checkpoint_dir), "every_steps": 100, "keep": 2,
                           "memory_every_steps": memory_every},
            "restart": {"max": 50, "backoff_s": 1},
        }
    return build


def job_json(box: ClusterBox) -> dict | None:
    """The leader's view of the job, as `trainerctl status -o json` prints it."""
    from daemon.cli.status_json import status_to_json

    reply = box.status()
    return None if reply is None else status_to_json(reply)["job"]


def run(steps: int, faulted: bool, args, root: Path) -> dict:
    out = root / ("faulted" if faulted else "clean") / "out"
    out.mkdir(parents=True)
    rng = random.Random(args.seed)
    faults: list[Fault] = []
    furthest: dict[int, int] = {}  # generation -> the furthest step status showed it at
    recovery: dict[int, dict] = {}  # generation -> the recovery that started it, as status showed it
    worlds: set[int] = set()
    build = transformer_job(steps, out, args.memory_every, args.spares)
    defaults = HeartbeatSettings()
    with ClusterBox(root / ("faulted" if faulted else "clean"), hosts=HOSTS + args.spares, job=build,
                    heartbeat_interval_s=defaults.interval_s, heartbeat_timeout_s=defaults.timeout_s,
                    warm_workers=True) as box:
        started = time.monotonic()
        wait_until(lambda: (j := job_json(box)) and j["state"] == "RUNNING", 300, "RUNNING",
                   on_timeout=box.procs.logs)
        next_fault = started + args.every_s * rng.uniform(0.5, 1.0)
        kinds = list(args.faults)
        rng.shuffle(kinds)
        while True:
            job = job_json(box)
            if job is not None:
                generation = job["generation"]
                if job["state"] == "RUNNING":
                    if job["step"] is not None:
                        furthest[generation] = max(furthest.get(generation, 0), job["step"])
                        worlds.add(job["world_size"])
                    # Only while the generation runs is the last recovery the one that started it: once it is
                    # stopping, status shows the next one, not yet launched.
                    if job["last_recovery"] is not None:
                        recovery[generation] = job["last_recovery"]
                if job["state"] in ("COMPLETED", "FAILED"):
                    break
                if faulted and time.monotonic() >= next_fault and job["state"] == "RUNNING":
                    kind = kinds[len(faults) % len(kinds)]
                    faults.append(inject(box, kind, job, rng, args, started))
                    next_fault = time.monotonic() + args.every_s
            time.sleep(1.0)
        wall_s = time.monotonic() - started
        job = job_json(box)
        assert job is not None
        attribute(faults, furthest, recovery)
        timeline = [(event.at, event.kind, event.message) for event in box.events()
                    if event.kind not in UNTOLD_EVENTS] if faulted else []
        return {"job": job, "wall_s": wall_s, "faults": faults, "out": out, "worlds": worlds, "timeline": timeline}


def attribute(faults: list[Fault], furthest: dict[int, int], recovery: dict[int, dict]) -> None:
    """Each generation after the first was started by the last fault injected before it: its cost is the
    steps from where it resumed to the furthest step the generation before it reached."""
    for generation in sorted(g for g in recovery if g > 1):
        cause = [f for f in faults if f.generation_before < generation]
        if not cause:
            continue
        phases = recovery[generation]
        resumed = phases.get("resumed_from_step") or 0
        lost = max(0, furthest.get(generation - 1, resumed) - resumed)
        cause[-1].relaunches.append({"generation": generation, "cause": phases.get("cause"), "resumed": resumed,
                                     "lost_steps": lost, **{k: v for k, v in phases.items()
                                                             if k.endswith("_s") and v is not None}})


def unproductive_s(job: dict) -> float:
    goodput = job.get("goodput") or {}
    return (goodput.get("wall_s") or 0.0) - (goodput.get("phases") or {}).get("productive_s", 0.0)


def print_ledgers(faults: list[Fault], clean: dict, faulted: dict) -> None:
    """Each fault's ledger, the sums per kind and in all, and the goodput difference beside them."""
    header = "".join(f"{part:>11}" for part in COST_PARTS)
    print(f"ledger of each fault (s): {'':>13}{header}{'sum':>9}")
    kinds: dict[str, dict[str, float]] = {}
    for f in faults:
        cost = f.cost_s
        into = kinds.setdefault(f.kind, dict.fromkeys(COST_PARTS, 0.0))
        for part in COST_PARTS:
            into[part] += cost[part]
        print(f"  {f.kind:>18} {f.at_s:>6.0f}s  " + "".join(f"{cost[p]:>11.2f}" for p in COST_PARTS)
              + f"{sum(cost.values()):>9.2f}")
    print("per kind:")
    for kind, cost in kinds.items():
        count = sum(1 for f in faults if f.kind == kind)
        print(f"  {kind:>18} x{count:<5}  " + "".join(f"{cost[p]:>11.2f}" for p in COST_PARTS)
              + f"{sum(cost.values()):>9.2f}")
    ledger = sum(sum(cost.values()) for cost in kinds.values())
    difference = unproductive_s(faulted["job"]) - unproductive_s(clean["job"])
    print(f"ledgers in all {ledger:.1f}s; goodput difference (faulted's seconds not productive less the clean "
          f"run's) {difference:.1f}s; not in a ledger {difference - ledger:.1f}s")



def inject(box: ClusterBox, kind: str, job: dict, rng: random.Random, args, started: float) -> Fault:
    step, generation = job.get("step") or 0, job["generation"]
    at = time.monotonic() - started
    if kind == "worker_crash":
        host = rng.choice([h for h in box.hosts if h.workers()])
        box.kill_worker(host.workers()[0])
        return Fault(kind, at, host.name, step, generation)
    if kind == "hang":
        host = rng.choice([h for h in box.hosts if h.workers()])
        worker = host.workers()[0]
        box.freeze_worker(worker)  # the coordinator's hang detection stops and relaunches the generation
        return Fault(kind, at, host.name, step, generation)
    if kind == "host_cut":
        host = rng.choice([h for h in box.hosts if h.workers()])  # not a spare standing by
        box.cut(host)
        time.sleep(args.heal_after_s)
        box.heal(host)
        return Fault(kind, at, host.name, step, generation)
    if kind == "coordinator_kill":
        leader = box.leader()
        assert leader is not None
        box.kill_coordinator(leader)
        wait_until(box.leader, 60, "a new leader")
        box.restart_coordinator(leader)
        return Fault(kind, at, leader.name, step, generation)
    if kind == "etcd_member_loss":
        assert box.etcd is not None
        member = box.etcd.leader() or box.etcd.members[0]
        box.etcd.kill(member)
        time.sleep(args.heal_after_s)
        box.etcd.restart(member)
        return Fault(kind, at, member.name, step, generation)
    raise ValueError(kind)


def weights(out: Path) -> dict[str, np.ndarray]:
    rank0 = np.load(out / "final_rank0.npz")
    return {name: rank0[name] for name in rank0.files}


def weight_difference(a: Path, b: Path) -> float:
    """The largest absolute difference between the two runs' final weights (0.0: bit-identical)."""
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys(), "the runs saved different tensors"
    return max(float(np.max(np.abs(wa[k].astype(np.float64) - wb[k].astype(np.float64)))) for k in wa)


def print_run(name: str, result: dict) -> None:
    job = result["job"]
    goodput = job.get("goodput") or {}
    phases = goodput.get("phases") or {}
    print(f"{name:>8}: {job['state']}, {job['step']} steps in {result['wall_s']:.0f}s, goodput "
          f"{100 * (goodput.get('ratio') or 0):.1f}%, restarts {job.get('restarts')}, generation {job['generation']}, "
          f"batches skipped {job.get('skipped_batches')} (nothing bad is injected: each is a false positive)")
    print("          " + "  ".join(f"{p[:-2]} {phases.get(p, 0):.1f}s" for p in PHASES))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6000, help="training steps of each run (a multiple of 100)")
    parser.add_argument("--every-s", type=float, default=300, help="seconds between faults")
    parser.add_argument("--heal-after-s", type=float, default=15, help="a cut host / killed etcd member returns after")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--memory-every", default="auto",
                        help="the job's checkpoint.memory_every_steps: auto (the default), a number of steps, "
                             "or 0 (no in-memory snapshots: the baseline they are measured against)")
    parser.add_argument("--spares", type=int, default=0, help="hosts beyond the job's 3, held as job.spare_nodes")
    parser.add_argument("--faults", default=",".join(FAULT_KINDS),
                        help=f"the fault kinds to rotate through, comma-separated (default: {','.join(FAULT_KINDS)})")
    args = parser.parse_args()
    args.faults = [k for k in args.faults.split(",") if k]
    unknown = sorted(set(args.faults) - set(FAULT_KINDS))
    if unknown or not args.faults or args.spares < 0:
        parser.error(f"--faults takes some of {', '.join(FAULT_KINDS)} and --spares a count"
                     + (f" (not {', '.join(unknown)})" if unknown else ""))
    if args.memory_every != "auto":
        if not args.memory_every.isdigit():
            parser.error("--memory-every takes auto or a number of steps")
        args.memory_every = int(args.memory_every)
    with tempfile.TemporaryDirectory(prefix="goodput-") as tmp:
        root = Path(tmp)
        clean = run(args.steps, False, args, root)
        faulted = run(args.steps, True, args, root)
        print(f"Transformer example, {args.steps} steps on {HOSTS} hosts with {args.spares} spare(s); a fault every "
              f"{args.every_s:.0f}s ({', '.join(args.faults)}; seed {args.seed}); in-memory snapshots every "
              f"{args.memory_every or 'never'}")
        print_run("clean", clean)
        print_run("faulted", faulted)
        print(f"{'fault':>18} {'at':>6} {'target':>7} {'step':>6}  generations it caused: cause, resumed step, "
              f"steps lost, recovery phases")
        for f in faulted["faults"]:
            caused = "; ".join(
                f"g{r['generation']} {r['cause']} from {r['resumed']} lost {r['lost_steps']} ("
                + " ".join(f"{k[:-2]} {r[k]:.1f}s" for k in ("stop_s", "relaunch_s", "first_step_s") if k in r) + ")"
                for r in f.relaunches)
            print(f"{f.kind:>18} {f.at_s:>5.0f}s {f.target:>7} {f.step_before:>6}  {caused or 'no restart'}")
        print_ledgers(faulted["faults"], clean, faulted)
        lost = [f.lost_steps for f in faulted["faults"]]
        print(f"lost steps per fault: mean {np.mean(lost) if lost else 0:.1f}, max {max(lost, default=0)}; "
              f"world sizes seen: {sorted(faulted['worlds'])}")
        difference = weight_difference(clean["out"], faulted["out"])
        verdict = "bit-identical" if difference == 0.0 else f"max |difference| {difference:.3g}"
        print(f"final weights against the fault-free run's: {verdict}"
              + ("" if faulted["worlds"] == {HOSTS} else
                 " (the world shrank on the way: steps at another world size sum their micro-batches in another "
                 "order)"))
        print("the faulted run, as the coordinator told it:")
        first = faulted["timeline"][0][0] if faulted["timeline"] else 0.0
        for at, kind, message in faulted["timeline"]:
            print(f"  {at - first:7.1f}s {kind:>18}  {message}")
        print(json.dumps({"clean": clean["job"].get("goodput"), "faulted": faulted["job"].get("goodput")}))


if __name__ == "__main__":
    main()
