"""Goodput under a fault schedule: the Transformer example on a cluster-in-a-box, faulted and not.

Two runs of the same job (same steps, seed and world size) on 3 hosts in network namespaces with a
3-member etcd and two coordinators (tests/cluster_box):

- a fault-free run, the baseline;
- a run where a seeded schedule injects one fault every `--every-s` seconds, rotating through: a
  worker crash (SIGKILL), a host cut off (link down, healed `--heal-after-s` later), a hung worker
  (SIGSTOP until the coordinator's hang detection stops the generation), the leading coordinator
  killed (restarted later), and an etcd member killed (restarted later).

It prints each run's goodput and its phases (trainerctl status -o json, `job.goodput`), every fault
with the steps it cost and its recovery phases, and whether both runs' final weights are equal (they
must be where the faulted run ended at the world size it began with). Needs root and iproute2.

    .venv/bin/python bench/goodput.py --steps 6000 --every-s 300     # the reported figure (~2 × 10 min)
    .venv/bin/python bench/goodput.py --steps 600 --every-s 40       # a quick look
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

from tests.cluster_box.box import ClusterBox  # noqa: E402
from tests.ports import free_port  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

FAULT_KINDS = ("worker_crash", "host_cut", "hang", "coordinator_kill", "etcd_member_loss")
HOSTS = 3
HANG_TIMEOUT_S = 20
PHASES = ("productive_s", "lost_work_s", "detection_s", "relaunch_s", "startup_s", "checkpoint_stall_s",
          "waiting_s", "paused_s")


@dataclass
class Fault:
    kind: str
    at_s: float
    target: str
    step_before: int
    resumed_from_step: int | None = None
    lost_steps: int = 0
    recovery: dict = field(default_factory=dict)


def transformer_job(steps: int, out: Path):
    def build(box: ClusterBox) -> dict:
        return {
            "name": "lm",
            "entrypoint": ["{python}", "-m", "trainer.examples.transformer_lm", "--steps", str(steps),
                           "--steps-per-epoch", "100", "--log-every", "500", "--output", str(out)],
            "min_nodes": 2, "max_nodes": HOSTS, "global_batch": 48, "micro_batch": 8,
            "scheduler_port": free_port(), "stop_grace_s": 3, "start_wait_s": 60,
            "hang_timeout_s": HANG_TIMEOUT_S,
            "checkpoint": {"dir": str(box.checkpoint_dir), "every_steps": 100, "keep": 2},
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
    with ClusterBox(root / ("faulted" if faulted else "clean"), hosts=HOSTS, job=transformer_job(steps, out)) as box:
        started = time.monotonic()
        wait_until(lambda: (j := job_json(box)) and j["state"] == "RUNNING", 300, "RUNNING",
                   on_timeout=box.procs.logs)
        next_fault = started + args.every_s * rng.uniform(0.5, 1.0)
        kinds = list(FAULT_KINDS)
        rng.shuffle(kinds)
        while True:
            job = job_json(box)
            if job is not None and job["state"] in ("COMPLETED", "FAILED"):
                break
            if faulted and time.monotonic() >= next_fault and job is not None and job["state"] == "RUNNING":
                kind = kinds[len(faults) % len(kinds)]
                faults.append(inject(box, kind, job, rng, args, started))
                next_fault = time.monotonic() + args.every_s
            if faults:
                account(faults[-1], job)
            time.sleep(1.0)
        wall_s = time.monotonic() - started
        job = job_json(box)
        assert job is not None
        if faults:
            account(faults[-1], job)
        return {"job": job, "wall_s": wall_s, "faults": faults, "out": out, "world_size": job.get("world_size")}


def inject(box: ClusterBox, kind: str, job: dict, rng: random.Random, args, started: float) -> Fault:
    step = job.get("step") or 0
    at = time.monotonic() - started
    if kind == "worker_crash":
        host = rng.choice([h for h in box.hosts if h.workers()])
        box.kill_worker(host.workers()[0])
        return Fault(kind, at, host.name, step)
    if kind == "hang":
        host = rng.choice([h for h in box.hosts if h.workers()])
        worker = host.workers()[0]
        box.freeze_worker(worker)  # the coordinator's hang detection stops and relaunches the generation
        return Fault(kind, at, host.name, step)
    if kind == "host_cut":
        host = rng.choice(box.hosts)
        box.cut(host)
        time.sleep(args.heal_after_s)
        box.heal(host)
        return Fault(kind, at, host.name, step)
    if kind == "coordinator_kill":
        leader = box.leader()
        assert leader is not None
        box.kill_coordinator(leader)
        wait_until(box.leader, 60, "a new leader")
        box.restart_coordinator(leader)
        return Fault(kind, at, leader.name, step)
    if kind == "etcd_member_loss":
        assert box.etcd is not None
        member = box.etcd.leader() or box.etcd.members[0]
        box.etcd.kill(member)
        time.sleep(args.heal_after_s)
        box.etcd.restart(member)
        return Fault(kind, at, member.name, step)
    raise ValueError(kind)


def account(fault: Fault, job: dict | None) -> None:
    """The fault's cost, once the job's last recovery is this fault's: steps redone and phase times."""
    if job is None:
        return
    recovery = job.get("last_recovery") or {}
    resumed = recovery.get("resumed_from_step")
    if resumed is not None and recovery.get("first_step_s") is not None and resumed <= fault.step_before \
            and fault.resumed_from_step is None:
        fault.resumed_from_step = resumed
        fault.lost_steps = fault.step_before - resumed
        fault.recovery = {k: v for k, v in recovery.items() if k.endswith("_s") and v is not None}


def weights(out: Path) -> dict[str, np.ndarray]:
    rank0 = np.load(out / "final_rank0.npz")
    return {name: rank0[name] for name in rank0.files}


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)


def print_run(name: str, result: dict) -> None:
    job = result["job"]
    goodput = job.get("goodput") or {}
    phases = goodput.get("phases") or {}
    print(f"{name:>8}: {job['state']}, {job['step']} steps in {result['wall_s']:.0f}s, goodput "
          f"{100 * (goodput.get('ratio') or 0):.1f}%, restarts {job.get('restarts')}, generation {job['generation']}")
    print("          " + "  ".join(f"{p[:-2]} {phases.get(p, 0):.1f}s" for p in PHASES))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6000, help="training steps of each run (a multiple of 100)")
    parser.add_argument("--every-s", type=float, default=300, help="seconds between faults")
    parser.add_argument("--heal-after-s", type=float, default=15, help="a cut host / killed etcd member returns after")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="goodput-") as tmp:
        root = Path(tmp)
        clean = run(args.steps, False, args, root)
        faulted = run(args.steps, True, args, root)
        print(f"Transformer example, {args.steps} steps on {HOSTS} hosts; a fault every {args.every_s:.0f}s "
              f"(seed {args.seed})")
        print_run("clean", clean)
        print_run("faulted", faulted)
        print(f"{'fault':>18} {'at':>6} {'target':>7} {'step':>6} {'resumed':>7} {'lost':>5}  recovery phases")
        for f in faulted["faults"]:
            phases = " ".join(f"{k[:-2]} {v:.2f}s" for k, v in f.recovery.items())
            resumed = "-" if f.resumed_from_step is None else str(f.resumed_from_step)
            print(f"{f.kind:>18} {f.at_s:>5.0f}s {f.target:>7} {f.step_before:>6} {resumed:>7} {f.lost_steps:>5}  "
                  f"{phases or 'no restart'}")
        equal = same_weights(clean["out"], faulted["out"])
        print(f"final weights equal to the fault-free run's: {'yes' if equal else 'NO'} (world size at the end: "
              f"{faulted['world_size']} of {HOSTS})")
        print(json.dumps({"clean": clean["job"].get("goodput"), "faulted": faulted["job"].get("goodput")}))


if __name__ == "__main__":
    main()
