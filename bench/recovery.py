"""Recovery after a fault: how long trainerd takes to notice it, stop the job, relaunch it and train
again, beside MindSpore's msrun on the same job with the same fault, in the same run.

The job is the built-in example (`trainer.examples.mlp`, the job of bench/launch.py: global batch 64,
micro batch 32) on 2 workers x 1 CPU device, saving a checkpoint every 100 steps. Each fault is
injected --repeats times, always once the job is RUNNING and has committed a checkpoint since its
last (re)start, so that every recovery resumes from a checkpoint:

- worker crash: SIGKILL of rank 1's worker process;
- worker crash, one host: the same on a job whose 2 ranks run on one agent (`--cpu-devices 2`,
  min_nodes = max_nodes = 1), the case where in-memory snapshots apply (checkpoint.memory_every_steps
  "auto", the default): the relaunch resumes from the newest snapshot rather than the disk checkpoint;
- node loss: SIGKILL of the agent of rank 1's node and of every training process it had started
  (the host is gone). The kernel closes the killed processes' connections, so the coordinator sees
  the agent's session break and declares the node LOST after the session grace (2 x the heartbeat
  interval), and the surviving rank sees its peer's connection drop;
- silent node loss: the same host frozen instead (SIGSTOP of the agent and its training processes,
  SIGKILL after the recovery): like a host that lost power or its network, it breaks no
  connection, so the coordinator can only notice that its heartbeats stopped (heartbeat.timeout_s).
  Both node losses run twice: with in-memory snapshots (the survivor holds the lost node's ranks in the
  copies its agent made of them, and the spare fetches them) and, as the baseline, without (", no
  snapshots": checkpoint.memory_every_steps 0, the disk checkpoint only); the lost steps column shows
  what the snapshots save.

trainerd: `trainerd start` on a temporary cluster file (embedded etcd, heartbeat interval_s 1.0 and
timeout_s 5.0, the defaults, so the detection target below applies), separate `trainerd-agent`s
with 1 CPU device each, min_nodes = max_nodes = 2, stop_grace_s 5 (the default) and
restart.backoff_s 0: the default waits 1 s after a first crash (doubling per further crash) before
relaunching, a configured pause that is not the coordinator's work. For the node losses a third,
idle agent stands by as a spare, so the job relaunches at the same world size 2 on the survivor and
the spare (rather than min_nodes 1, which would continue on 1 rank: a smaller job whose first step
after the relaunch is cheaper, not comparable with the crash). The killed agent is started again
afterwards (a frozen one is killed first) and becomes the next spare. All faults of one kind are injected into one job.

Phases, in seconds from the fault (t0: time.time() right before the first kill) to the
coordinator's events (their `at` is time.time() in trainerd, on this same machine):

    detect            recovery_started
    stopped           detect + fields.recovery.stop of job_running (stop decided -> every node idle)
    relaunch issued   generation_started of the next generation (the Launches go out right after)
    first step        job_running: every rank of the new generation has reported a step
    coordinator part  relaunch issued - detect: stopping the survivors, choosing the nodes and the
                      checkpoint, writing the generation

msrun (the baseline): `msrun --worker_num=2 --local_worker_num=2 --join=True ... mlp.py` with the
same job, environment and checkpoint schedule, MindSpore's defaults (MS_NODE_TIMEOUT 30 s), and the
same worker crash once a checkpoint exists. detect is msrun's "Worker process N exit with
exception" log line (it polls its workers every second), stopped is msrun's exit: it SIGKILLs the
other workers at once, then waits for its scheduler, which exits only after its node timeout.
msrun 2.10 does not recover: its CLI has no restart option (its restart path exists only under the
MindX DL taskd plug-in), so relaunch issued, first step and coordinator part are n/a. The node
losses have no msrun row: msrun on one host cannot survive its own host.

Warm workers: the worker crash runs twice, in two jobs, once with the agents' defaults (warm workers
and MindSpore's compile cache on: the relaunch runs in interpreters that imported MindSpore already
and loads the graph compiled by the previous generation) and once with both off
(`--no-warm-workers --no-compile-cache`: every process a new interpreter that compiles, the
baseline), rows "worker crash" and "worker crash, cold". Target: worker crash -> first step within
3 s, or MindSpore's communication set-up (the breakdown's "comm set-up (init)" part: MindSpore's
`init()`, cluster formation and the mccl address exchange) + 0.5 s where that alone takes longer.
The node losses run with the defaults.

Every trainerd recovery also shows what it resumed from (`last_recovery.resumed_from` of
`trainerctl status -o json`: "memory" or "disk", and the step) and the steps it lost (`lost_steps`: the
furthest step the failed generation reported minus the step resumed from). Only a one-host generation
takes snapshots, so the 2-agent rows resume from disk (up to CHECKPOINT_EVERY steps lost).

Prints every recovery as it happens (for trainerd with where the first-step phase went, per rank
of the new generation, from its log: Python + import mindspore, communication set-up (MindSpore's
`init()`), model + checkpoint resume, first compile + step), then the medians over the repeats and the targets: node
loss detected within 2 x heartbeat interval + 1 s (3 s), coordinator part under 1 s. Takes about
7 minutes with 3 repeats on 2 cores.

    /work/main/.venv/bin/python bench/recovery.py --repeats 3
    /work/main/.venv/bin/python bench/recovery.py --repeats 3 --faults crash --no-msrun   # warm vs cold only
    /work/main/.venv/bin/python bench/recovery.py --repeats 2 --faults crash,crash_one_host --no-msrun  # lost steps
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.launch import (  # noqa: E402
    BIN,
    GLOBAL_BATCH,
    LOG_TIME,
    MICRO_BATCH,
    SPEED_UP_ENV,
    WORLD_SIZE,
    BenchError,
    CpuMeter,
    Processes,
    clean_env,
    clean_up,
    free_ports,
    interrupt_on_signals,
    log_time,
    median,
    msrun_argv,
    msrun_env,
    rank_marks,
    tail,
    trainerctl,
)
from proto.launch_env import BENCH_LAUNCH_MARKER_ENV  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 5.0
CHECKPOINT_EVERY = 100
DETECT_TARGET_S = 2 * HEARTBEAT_INTERVAL_S + 1.0
COORDINATOR_TARGET_S = 1.0
DEFAULT_STEPS = 1_000_000  # the job must outlast every fault; the bench stops it at the end

FAULTS = {"crash": "worker crash", "crash_one_host": "worker crash, one host", "node_loss": "node loss",
          "silent_node_loss": "silent node loss"}
CRASH_FAULTS = ("crash", "crash_one_host")
COLD = ", cold"  # the row suffix of the runs with warm workers and the compile cache off
NO_SNAPSHOTS = ", no snapshots"  # the row suffix of the node losses with in-memory snapshots off (disk only)
WARM_TARGET_S = 3.0
WARM_COMM_MARGIN_S = 0.5
NODE_FAULTS = ("node_loss", "silent_node_loss")
COLUMNS = (("detect", "detect"), ("stopped", "stopped"), ("relaunch", "relaunch issued"),
           ("first_step", "first step"), ("coordinator", "coordinator part"))
STEP_LINE = re.compile(r" rank \d+/\d+: step \d+ loss ")
# Rank 0's choice of the automatic snapshot interval (trainer/runtime/memory_snapshots.py)
SNAPSHOT_PLAN = re.compile(r"snapshot of step (\d+) stalled ([\d.]+) s, steps take (\S+(?: s)?): "
                           r"the next is in (\d+) steps")
# MindSpore's Python logger: "[ERROR] ME(123:456,MainProcess):2025-01-02-03:04:05.678.901 [file:line] message"
# trainer/runtime/communication.py's line after MindSpore's init() returned.
JOINED_LINE = re.compile(LOG_TIME + r" .*: rank \d+ of \d+ joined the cluster in ")
MS_LOG_TIME = r"(\d{4}-\d\d-\d\d-\d\d:\d\d:\d\d\.\d{3})"


@dataclass
class Recovery:
    """One fault and what followed, in seconds from the fault; None where the launcher has no such moment."""

    launcher: str
    fault: str
    warm: bool = True
    snapshots: bool = True  # checkpoint.memory_every_steps as asked (else 0: disk checkpoints only)
    detect: float | None = None
    stopped: float | None = None
    relaunch: float | None = None
    first_step: float | None = None
    coordinator: float | None = None
    disturbed: bool = False  # a relaunch failed too: left out of the medians
    notes: list[str] = field(default_factory=list)
    comm_s: float | None = None  # the longest rank's communication set-up in the new generation
    resumed_from: str | None = None  # status last_recovery: "memory", "disk", None (from scratch)
    resumed_step: int | None = None
    lost_steps: int | None = None

    @property
    def row(self) -> str:
        return f"{self.launcher} {FAULTS[self.fault]}" + ("" if self.warm else COLD) + \
            ("" if self.snapshots else NO_SNAPSHOTS)


# ---------------------------------------------------------------- helpers

def free_port_run(count: int) -> int:
    """A port p such that p .. p + count - 1 are all free now (generation g's scheduler port is
    scheduler_port + g % 16)."""
    for _ in range(100):
        (base,) = free_ports(1)
        sockets = []
        try:
            for port in range(base, base + count):
                sockets.append(socket.socket())
                sockets[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise BenchError(f"no run of {count} free ports found")


def become_subreaper() -> None:
    """Make this process the reaper of its orphaned descendants: the workers of a killed agent then
    become its children, and their CPU time counts as this bench's in CpuMeter (not as other load)."""
    import ctypes
    pr_set_child_subreaper = 36
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0)


def reap(pids: list[int], timeout_s: float = 10.0) -> None:
    """Wait for orphans this process inherited as their subreaper (ignored if they are not its children)."""
    deadline = time.monotonic() + timeout_s
    pending = set(pids)
    while pending and time.monotonic() < deadline:
        for pid in list(pending):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    pending.discard(pid)
            except ChildProcessError:
                pending.discard(pid)
        time.sleep(0.05)


def marked_training_processes(marker: str) -> list[tuple[psutil.Process, dict[str, str]]]:
    """Live training processes (scheduler and workers) that carry this bench's marker, with their environment."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "mlp" not in " ".join(proc.info["cmdline"] or []):
                continue
            env = proc.environ()
            if env.get(BENCH_LAUNCH_MARKER_ENV) == marker and env.get("MS_ROLE") in ("MS_WORKER", "MS_SCHED"):
                found.append((proc, env))
        except psutil.Error:
            continue
    return found


def worker_of_rank(marker: str, rank: int) -> psutil.Process:
    for proc, env in marked_training_processes(marker):
        if env.get("MS_ROLE") == "MS_WORKER" and env.get("RANK_ID") == str(rank):
            return proc
    raise BenchError(f"no worker process of rank {rank} found")


def events(coordinator: str) -> list[dict]:
    result = trainerctl(coordinator, "events", "-o", "json")
    if result.returncode != 0:
        raise BenchError(f"trainerctl events failed ({result.returncode}): {result.stderr.strip()}")
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def status(coordinator: str) -> dict | None:
    try:
        result = trainerctl(coordinator, "status", "-o", "json")
    except subprocess.TimeoutExpired:
        return None
    return json.loads(result.stdout) if result.returncode == 0 else None


def log_tails(*paths: Path) -> str:
    return "\n".join(f"  {p}:\n{tail(p)}" for p in paths)


# ---------------------------------------------------------------- trainerd

class TrainerdCluster:
    """trainerd with an embedded etcd and separate agents, all on this machine, under `root`."""

    def __init__(self, procs: Processes, root: Path, nodes: int, steps: int, timeout_s: float,
                 warm: bool = True, one_host: bool = False, memory_every: str = "auto") -> None:
        """`one_host`: one agent holds both ranks (`nodes` must be 1), else an agent per rank."""
        self.procs, self.root, self.timeout_s, self.warm = procs, root, timeout_s, warm
        self.memory_every = memory_every
        self.devices = WORLD_SIZE if one_host else 1
        hosts = WORLD_SIZE // self.devices
        coordinator_port, etcd_client, etcd_peer = free_ports(3)
        self.coordinator = f"127.0.0.1:{coordinator_port}"
        self.env = {**clean_env(), **SPEED_UP_ENV}
        cluster = {  # JSON is YAML
            "cluster": {
                "name": "bench",
                "coordinator": {"listen": self.coordinator},
                "etcd": {"endpoints": [], "data_dir": str(root / "etcd"),
                         "client_listen": f"127.0.0.1:{etcd_client}", "peer_listen": f"127.0.0.1:{etcd_peer}"},
                "heartbeat": {"interval_s": HEARTBEAT_INTERVAL_S, "timeout_s": HEARTBEAT_TIMEOUT_S},
            },
            "job": {
                "name": "mlp-recovery",
                "entrypoint": ["{python}", "-m", "trainer.examples.mlp", "--steps", str(steps),
                               "--output", str(root / "out")],
                "devices_per_node": self.devices, "min_nodes": hosts, "max_nodes": hosts,
                "global_batch": GLOBAL_BATCH, "micro_batch": MICRO_BATCH,
                "scheduler_port": free_port_run(17), "start_wait_s": 0,
                "restart": {"backoff_s": 0},
                "checkpoint": {"dir": str(root / "checkpoints"), "every_steps": CHECKPOINT_EVERY, "keep": 3,
                               "memory_every_steps": memory_every if memory_every == "auto" else int(memory_every)},
            },
        }
        cluster_file = root / "cluster.yaml"
        cluster_file.write_text(json.dumps(cluster, indent=2))
        self.trainerd_log = root / "trainerd.log"
        self.trainerd = procs.start([str(BIN / "trainerd"), "start", "--cluster", str(cluster_file)],
                                    self.trainerd_log, self.env, root)
        self.agents: dict[str, subprocess.Popen] = {}
        self.frozen: dict[str, list[psutil.Process]] = {}  # node -> its SIGSTOPped training processes
        for i in range(nodes):
            self.start_agent(f"n{i}")

    def agent_dir(self, node: str) -> Path:
        return self.root / "agents" / node

    def memory_dir(self, node: str) -> Path:
        """The agent's in-memory snapshots, on tmpfs: a killed agent cannot remove them (`main` does)."""
        return shared_memory_root(self.root.parent) / self.root.name / node

    def start_agent(self, node: str) -> None:
        self.agent_dir(node).mkdir(parents=True, exist_ok=True)
        self.agents[node] = self.procs.start(
            [str(BIN / "trainerd-agent"), "--coordinator", self.coordinator, "--node-name", node,
             "--cpu-devices", str(self.devices), "--work-dir", str(self.agent_dir(node)),
             "--memory-dir", str(self.memory_dir(node)),
             *(("--compile-cache",) if self.warm else ("--no-warm-workers", "--no-compile-cache"))],
            self.root / f"agent-{node}.log", self.env, self.root)

    def stop(self) -> None:
        """Agents first (they stop and reap their training processes), then trainerd (it stops etcd)."""
        for node in list(self.frozen):
            self.kill_host(node, self.frozen.pop(node))
        for popen in [*self.agents.values(), self.trainerd]:
            if popen is self.trainerd:
                for agent in self.agents.values():
                    try:
                        agent.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        pass
            if popen.poll() is None:
                popen.send_signal(signal.SIGTERM)
        try:
            self.trainerd.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def logs(self) -> str:
        return log_tails(self.trainerd_log, *(self.root / f"agent-{n}.log" for n in sorted(self.agents)))

    def check_alive(self) -> None:
        if self.trainerd.poll() is not None:
            raise BenchError(f"trainerd exited with code {self.trainerd.returncode}\n{self.logs()}")

    def job(self) -> dict | None:
        self.check_alive()
        job = (status(self.coordinator) or {}).get("job")
        if job and job["state"] in ("FAILED", "COMPLETED"):
            raise BenchError(f"the job is {job['state']} before the fault: {job.get('last_failure')}\n{self.logs()}")
        return job

    def generation_started(self, generation: int) -> dict | None:
        return next((e for e in events(self.coordinator)
                     if e["kind"] == "generation_started" and e["fields"].get("generation") == generation), None)

    def wait_ready_for_fault(self) -> dict:
        """The job RUNNING with a checkpoint committed since its current generation started; its status."""
        def ready():
            job = self.job()
            if not job or job["state"] != "RUNNING":
                return None
            started = self.generation_started(job["generation"])
            resumed_from = (started or {}).get("fields", {}).get("resume_step") or 0
            return job if (job["last_checkpoint_step"] or 0) > resumed_from else None
        return wait_until(ready, self.timeout_s, "the job RUNNING past a checkpoint of its generation", 1.0, self.logs,
                          error=BenchError)

    def wait_node_ready(self, node: str) -> None:
        def ready():
            self.check_alive()
            data = status(self.coordinator)
            return data and any(n["name"] == node and n["state"] == "READY" for n in data["nodes"])
        wait_until(ready, self.timeout_s, f"node {node} READY", 0.5, self.logs, error=BenchError)

    def inject(self, fault: str) -> tuple[float, int, str]:
        """SIGKILL rank 1's worker, or its node (agent and training processes); (t0, generation, node)."""
        job = self.job()
        victim = worker_of_rank(self.procs.marker, 1)
        node = Path(victim.cwd()).relative_to(self.root / "agents").parts[0]
        if fault in CRASH_FAULTS:
            t0 = time.time()
            victim.kill()
            return t0, job["generation"], node
        agent = self.agents[node]
        on_host = [p for p, _ in marked_training_processes(self.procs.marker)
                   if p.cwd().startswith(str(self.agent_dir(node)) + os.sep)]
        if fault == "silent_node_loss":
            t0 = time.time()
            os.killpg(agent.pid, signal.SIGSTOP)  # frozen: its connections stay open, nothing more is sent
            for proc in on_host:
                proc.suspend()
            self.frozen[node] = on_host
            return t0, job["generation"], node
        t0 = time.time()
        self.kill_host(node, on_host)
        return t0, job["generation"], node

    def kill_host(self, node: str, on_host: list[psutil.Process]) -> None:
        """SIGKILL a node's agent (its own session) and the training processes it had started."""
        agent = self.agents[node]
        os.killpg(agent.pid, signal.SIGKILL)
        for proc in on_host:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        agent.wait(timeout=10)
        reap([p.pid for p in on_host])  # orphaned: the agent that would have reaped them is gone

    def restore_host(self, node: str) -> None:
        """The host is back (a frozen one is killed first): a fresh agent under the same name."""
        if node in self.frozen:
            self.kill_host(node, self.frozen.pop(node))
        self.start_agent(node)

    def measure(self, fault: str, t0: float, generation: int, node: str) -> Recovery:
        """Wait until a generation after `generation` has taken its first steps (from the rank logs: no
        trainerctl process competes with the starting ranks for the cores), then read the phases from
        the events. Should a relaunch fail too, the recovery ends at the first job_running after the
        fault and is marked disturbed."""
        first = generation + 1

        def newest_generation_stepped() -> int | None:
            self.check_alive()
            numbers = [int(d.name) for d in self.root.glob("agents/*/generations/*") if d.name.isdigit()]
            newest = max([n for n in numbers if n >= first], default=None)
            if newest is None:
                return None
            logs = list(self.root.glob(f"agents/*/generations/{newest:06d}/rank*.log"))
            stepped = len(logs) == WORLD_SIZE and all(STEP_LINE.search(p.read_text(errors="replace")) for p in logs)
            return newest if stepped else None
        wait_until(newest_generation_stepped, self.timeout_s, f"generation {first} (or a later one) taking steps",
                   0.2, lambda: (json.dumps(status(self.coordinator) or {}, indent=1)[-3000:] + "\n" + self.logs()),
                   error=BenchError)

        def running():
            evs = events(self.coordinator)
            started = next((e for e in evs if e["kind"] == "generation_started"
                            and e["fields"].get("generation") == first), None)
            done = started and next((e for e in evs if e["kind"] == "job_running" and e["seq"] > started["seq"]),
                                    None)
            return done and (evs, started, done)
        evs, started, done = wait_until(running, self.timeout_s, "job_running after the fault", 0.5, self.logs,
                                        error=BenchError)

        detected = next((e for e in evs if e["kind"] == "recovery_started" and e["at"] > t0 - 0.05), None)
        if detected is None or detected["seq"] > started["seq"]:
            raise BenchError(f"no recovery_started event between the fault and generation {first}")
        last = [e for e in evs if e["kind"] == "generation_started" and e["seq"] < done["seq"]][-1]
        phases = done["fields"].get("recovery") or {}
        rec = Recovery("trainerd", fault, warm=self.warm, snapshots=self.memory_every != "0")
        rec.detect = detected["at"] - t0
        rec.relaunch = started["at"] - t0
        rec.first_step = done["at"] - t0
        rec.coordinator = started["at"] - detected["at"]
        failure = detected["fields"].get("failure", {})
        expected = "process_exited" if fault in CRASH_FAULTS else "node_lost"
        if failure.get("cause") != expected:
            rec.notes.append(f"the recovery's cause is {failure.get('cause')}, expected {expected}")
        lost = next((e for e in evs if e["kind"] == "node_lost" and e["at"] > t0 - 0.05), None)
        if lost is not None:
            rec.notes.append(f"node_lost at {lost['at'] - t0:.2f} s")
        rec.notes.append(f"killed on {node}; generation {first} on {', '.join(started['fields'].get('nodes', []))} "
                         f"from step {started['fields'].get('resume_step')}")
        if last is started:
            if phases.get("stop") is not None:
                rec.stopped = rec.detect + phases["stop"]
            rec.notes.append("coordinator's phases: " + ", ".join(
                f"{k} {v:.2f} s" for k, v in phases.items() if isinstance(v, (int, float))))
        else:
            # the timeline of job_running belongs to the last recovery only: no stop figure for the first
            rec.disturbed = True
            later = (e for e in evs if e["kind"] == "recovery_started" and started["seq"] < e["seq"] < done["seq"])
            for again in later:
                rec.notes.append(f"DISTURBED: at {again['at'] - t0:.2f} s generation "
                                 f"{again['fields'].get('generation')} failed too: {again['message'][:300]}")
            rec.notes.append(f"running again at generation {last['fields'].get('generation')}, relaunched at "
                             f"{last['at'] - t0:.2f} s")
        recovery = (self.job() or {}).get("last_recovery") or {}
        rec.resumed_from, rec.resumed_step = recovery.get("resumed_from"), recovery.get("resumed_from_step")
        rec.lost_steps = recovery.get("lost_steps")
        rec.notes.extend(snapshot_intervals(self.root, generation))
        breakdown, rec.comm_s = first_step_breakdown(self.root, last["fields"].get("generation"), last["at"])
        rec.notes.append(breakdown)
        rec.notes.append(started_how(self.root, sorted(self.agents)))
        return rec


def first_step_breakdown(root: Path, generation: int, launched_at: float) -> tuple[str, float | None]:
    """Where the first-step phase went, per rank of `generation`, from its log (see bench/launch.py),
    and the longest communication set-up of its ranks: MindSpore's `init()` (cluster formation, mccl
    set-up), from the rank's "joining the cluster" line to its "joined the cluster" line."""
    parts, comm = [], []
    for log_path in sorted(root.glob(f"agents/*/generations/{generation:06d}/rank*.log")):
        marks = rank_marks(log_path)
        joined = JOINED_LINE.search(log_path.read_text(errors="replace"))
        if joined:
            marks["joined"] = log_time(joined.group(1))
        previous, cells = launched_at, []
        for key, label in (("import_done", "python + import"), ("joined", "comm set-up (init)"),
                           ("comm_done", "model + resume"), ("first_step", "compile + step")):
            if key in marks:
                cells.append(f"{label} {marks[key] - previous:.2f}")
                previous = marks[key]
        if "joined" in marks and "import_done" in marks:
            comm.append(marks["joined"] - marks["import_done"])
        parts.append(f"{log_path.stem} " + ", ".join(cells))
    return ("first step, from generation_started: " + "; ".join(parts) + " (s)",
            max(comm) if comm else None)


def snapshot_intervals(root: Path, generation: int) -> list[str]:
    """The automatic snapshot interval rank 0 of `generation` chose last, from its log (none: no snapshots)."""
    found = []
    for log_path in root.glob(f"agents/*/generations/{generation:06d}/rank0.log"):
        found += SNAPSHOT_PLAN.findall(log_path.read_text(errors="replace"))
    if not found:
        return []
    step, stall, step_s, interval = found[-1]
    return [f"auto snapshots in generation {generation}: {len(found)} taken; the last (step {step}) stalled {stall} s, "
            f"steps took {step_s} -> every {interval} steps"]


def started_how(root: Path, nodes: list[str]) -> str:
    """How each agent started its processes the last time (the words of its log)."""
    cells = []
    for node in nodes:
        log_path = root / f"agent-{node}.log"
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        hows = re.findall(r"started pid \d+ (warm|cold(?: \([^)]*\))?)", text)
        cells.append(f"{node} {hows[-1] if hows else 'not logged'}")
    return "last process started by each agent: " + "; ".join(cells)


def run_trainerd(procs: Processes, root: Path, fault: str, repeats: int, steps: int, timeout_s: float,
                 report, warm: bool = True, memory_every: str = "auto") -> None:
    """Inject `fault` `repeats` times into one job; `report(recovery, index)` after each recovery."""
    one_host = fault == "crash_one_host"
    nodes = 1 if one_host else WORLD_SIZE + (1 if fault in NODE_FAULTS else 0)
    cluster = TrainerdCluster(procs, root, nodes, steps, timeout_s, warm, one_host, memory_every)
    try:
        for index in range(1, repeats + 1):
            cluster.wait_ready_for_fault()
            if fault in NODE_FAULTS:
                for node in cluster.agents:
                    cluster.wait_node_ready(node)  # the spare (the node killed last time, restarted)
            t0, generation, node = cluster.inject(fault)
            report(cluster.measure(fault, t0, generation, node), index)
            if fault in NODE_FAULTS:
                cluster.restore_host(node)  # the host is back: the next spare
    finally:
        cluster.stop()
        procs.kill_all()


# ---------------------------------------------------------------- msrun

def alive(proc: psutil.Process) -> bool:
    """Running, not a zombie waiting for msrun to reap it."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def ms_log_time(stamp: str) -> float:
    return datetime.strptime(stamp[:-4] + "," + stamp[-3:], "%Y-%m-%d-%H:%M:%S,%f").timestamp()


def run_msrun(procs: Processes, root: Path, steps: int, timeout_s: float) -> Recovery:
    master_port = free_port_run(1)
    log_dir, checkpoints = root / "msrun_logs", root / "checkpoints"
    argv = msrun_argv(master_port, log_dir, timeout_s,
                      ["--steps", str(steps), "--checkpoint-dir", str(checkpoints),
                       "--checkpoint-every", str(CHECKPOINT_EVERY), "--output", str(root / "out")])
    msrun_log = root / "msrun.log"
    msrun = procs.start(argv, msrun_log, msrun_env(), root)

    def logs() -> str:
        return log_tails(msrun_log, *sorted(log_dir.glob("*.log")))

    try:
        def checkpointed() -> bool:
            if msrun.poll() is not None:
                raise BenchError(f"msrun exited with code {msrun.returncode} before the fault\n{logs()}")
            return any(checkpoints.glob("step_*/manifest.json"))
        wait_until(checkpointed, timeout_s, "msrun's first checkpoint", 0.2, logs, error=BenchError)
        victim = worker_of_rank(procs.marker, 1)
        others = {("scheduler" if env.get("MS_ROLE") == "MS_SCHED" else f"worker {env.get('RANK_ID')}"): proc
                  for proc, env in marked_training_processes(procs.marker) if proc.pid != victim.pid}
        t0 = time.time()
        victim.kill()
        gone: dict[str, float] = {}
        deadline = time.monotonic() + timeout_s
        while msrun.poll() is None:
            if time.monotonic() > deadline:
                raise BenchError(f"msrun still running {timeout_s:.0f} s after the fault\n{logs()}")
            for name, proc in others.items():
                if name not in gone and not alive(proc):
                    gone[name] = time.time() - t0
            time.sleep(0.05)
        exited = time.time() - t0
        for name in others:
            gone.setdefault(name, exited)
    finally:
        procs.kill_all()

    rec = Recovery("msrun", "crash", stopped=exited)
    text = msrun_log.read_text(errors="replace")
    match = re.search(MS_LOG_TIME + r".*Worker process " + str(victim.pid) + r" exit with exception", text)
    if match:
        rec.detect = ms_log_time(match.group(1)) - t0
    else:
        rec.notes.append("no 'Worker process ... exit with exception' line in msrun's log: detect unknown")
    timed_out = re.search(MS_LOG_TIME + r".*The node: \d+ is timed out", text)
    if timed_out:
        at = ms_log_time(timed_out.group(1)) - t0
        rec.notes.append(f"its scheduler declared the workers timed out at {at:.2f} s (MS_NODE_TIMEOUT), "
                         f"then finalized and exited")
    rec.notes.append(f"msrun exited with code {msrun.returncode}; processes gone after "
                     + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in sorted(gone.items())))
    return rec


# ---------------------------------------------------------------- output

def cell(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} s"


def resumed(rec: Recovery) -> str:
    """What the relaunch resumed from and the steps that cost, e.g. "12 (memory @340)"."""
    if rec.launcher != "trainerd":
        return "n/a"
    lost = "?" if rec.lost_steps is None else str(rec.lost_steps)
    return f"{lost} ({rec.resumed_from or 'scratch'} @{rec.resumed_step if rec.resumed_step is not None else 0})"


def print_recovery(rec: Recovery, index: int) -> None:
    print(f"\n{rec.row} #{index}: " + ", ".join(f"{label} {cell(getattr(rec, key))}" for key, label in COLUMNS)
          + f", lost steps {resumed(rec)}")
    for note in rec.notes:
        print(f"  {note}")
    sys.stdout.flush()


def verdict(values: list[float | None], target: float) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "not measured"
    met = sum(v <= target for v in values)
    value = median(values)
    return (f"median {value:.2f} s, worst {max(values):.2f} s -> {'met' if value <= target else 'NOT met'}"
            f" (in {met} of {len(values)} runs)")


def warm_verdict(recs: list[Recovery]) -> str:
    """The crash target per run: first step <= max(3 s, the slowest rank's comm set-up + 0.5 s)."""
    if not recs:
        return "not measured"
    cells, met = [], 0
    for rec in recs:
        if rec.first_step is None:
            continue
        target = max(WARM_TARGET_S, (rec.comm_s or 0.0) + WARM_COMM_MARGIN_S)
        met += rec.first_step <= target
        cells.append(f"{rec.first_step:.2f} s of {target:.2f} s")
    return f"{', '.join(cells)} -> met in {met} of {len(cells)} runs"


def lost_cell(recs: list[Recovery]) -> str:
    """Median lost steps and where the relaunches resumed from, e.g. "8 (memory 3)"."""
    if recs[0].launcher != "trainerd":
        return "n/a"
    lost = [r.lost_steps for r in recs if r.lost_steps is not None]
    sources = sorted({r.resumed_from or "scratch" for r in recs})
    counts = ", ".join(f"{s} {sum((r.resumed_from or 'scratch') == s for r in recs)}" for s in sources)
    return f"{median([float(n) for n in lost]):.0f} ({counts})" if lost else f"? ({counts})"


def print_summary(results: dict[str, list[Recovery]], failures: dict[str, str], loads: dict[str, float]) -> None:
    width = max(len(row) for row in results) + 2
    print("\nMedian over the repeats, seconds from the fault (t0 = the kill):")
    print(f"{'':{width}}{'runs':>5}" + "".join(f"{label:>18}" for _, label in COLUMNS) + "   lost steps (from)")
    for row, recs in results.items():
        clean = [r for r in recs if not r.disturbed]
        if not clean:
            what = "failed" if row in failures else "disturbed" if recs else "not run"
            print(f"{row:{width}}{0:>5}" + f"{what:>18}")
            continue
        cells = [cell(median([getattr(r, key) for r in clean])) for key, _ in COLUMNS]
        print(f"{row:{width}}{len(clean):>5}" + "".join(f"{c:>18}" for c in cells) + "   " + lost_cell(clean))
    print("msrun has no relaunch: after a worker crash it kills the other workers, waits for its scheduler "
          "and exits; the job is over.")
    for row, recs in results.items():
        for index, rec in enumerate(recs, 1):
            if rec.disturbed:
                print(f"left out of the medians: {row} #{index}, where a relaunch failed as well (see above)")

    print("\nTargets (heartbeat interval 1.0 s, timeout 5.0 s):")
    for fault in NODE_FAULTS:
        row = f"trainerd {FAULTS[fault]}"
        print(f"  {row} detected within 2 x interval + 1 s = {DETECT_TARGET_S:.1f} s: "
              + verdict([r.detect for r in results.get(row, [])], DETECT_TARGET_S))
    for row in (r for r in results if r.startswith("trainerd")):
        print(f"  {row}: coordinator part (detect -> relaunch issued) under {COORDINATOR_TARGET_S:.1f} s: "
              + verdict([r.coordinator for r in results.get(row, [])], COORDINATOR_TARGET_S))
    for row in (r for r in results if r in (f"trainerd {FAULTS['crash']}", f"trainerd {FAULTS['crash']}{COLD}")):
        print(f"  {row}: first step within {WARM_TARGET_S:.0f} s, or comm set-up (init) + {WARM_COMM_MARGIN_S} s where "
              f"that alone is longer: " + warm_verdict([r for r in results[row] if not r.disturbed]))
    if loads:
        print("\nOther processes kept busy on average (cores of " + str(os.cpu_count()) + "): "
              + ", ".join(f"{row} {load:.2f}" for row, load in loads.items()))
    for row, reason in failures.items():
        print(f"\n{row} failed: {reason}")


# ---------------------------------------------------------------- main

def shared_memory_root(root: Path) -> Path:
    """Where the bench's agents under `root` keep their in-memory snapshots."""
    return Path("/dev/shm") / root.name

def variants_of(fault: str) -> tuple[tuple[bool, bool], ...]:
    """(warm, snapshots) of the runs of `fault`."""
    if fault == "crash":
        return (True, True), (False, True)
    if fault in NODE_FAULTS:
        return (True, True), (True, False)
    return ((True, True),)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="faults of each kind per launcher (default 3)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"the example job's --steps; it must outlast every fault (default {DEFAULT_STEPS})")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any one wait may take (default 120)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory with every log")
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help=f"the faults to inject, comma-separated (default {','.join(FAULTS)})")
    parser.add_argument("--no-msrun", action="store_true", help="leave out the msrun baseline")
    parser.add_argument("--memory-every", default="auto",
                        help="the job's checkpoint.memory_every_steps: auto (the default) or a number of steps")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.memory_every != "auto" and not args.memory_every.isdigit():
        parser.error("--memory-every takes auto or a number of steps")
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    if not faults or any(f not in FAULTS for f in faults):
        parser.error(f"--faults takes some of {', '.join(FAULTS)}")
    # the worker crash with warm workers on (the default) and off (the baseline); node losses with in-memory
    # snapshots on (the survivors hold the lost node's ranks) and off (the baseline: the disk checkpoint)
    variants = [(f, warm, snapshots) for f in faults for warm, snapshots in variants_of(f)]

    interrupt_on_signals()

    become_subreaper()
    root = Path(tempfile.mkdtemp(prefix="trainerd-bench-recovery-"))
    procs = Processes()
    results: dict[str, list[Recovery]] = {Recovery("trainerd", f, warm=w, snapshots=m).row: [] for f, w, m in variants}
    if not args.no_msrun:
        results["msrun worker crash"] = []
    failures: dict[str, str] = {}
    loads: dict[str, float] = {}
    print(f"example job: {WORLD_SIZE} workers x 1 CPU device, global batch {GLOBAL_BATCH}, micro batch {MICRO_BATCH}, "
          f"a checkpoint every {CHECKPOINT_EVERY} steps; {args.repeats} fault(s) of each kind; {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f} at start", flush=True)
    started = time.monotonic()
    try:
        for fault, warm, snapshots in variants:
            row = Recovery("trainerd", fault, warm=warm, snapshots=snapshots).row
            work = root / f"trainerd-{fault}{'' if warm else '-cold'}{'' if snapshots else '-disk'}"
            work.mkdir()
            meter = CpuMeter()
            try:
                run_trainerd(procs, work, fault, args.repeats, args.steps, args.timeout,
                             lambda rec, i, row=row: (results[row].append(rec), print_recovery(rec, i)), warm,
                             args.memory_every if snapshots else "0")
            except (BenchError, subprocess.TimeoutExpired, OSError, psutil.Error) as exc:
                failures[row] = str(exc)
                print(f"\n{row} failed: {exc}", flush=True)
            loads[row] = meter.foreign_cores()
        row = "msrun worker crash"
        meter = CpuMeter()
        for index in range(1, 0 if args.no_msrun else args.repeats + 1):
            work = root / f"msrun-{index}"
            work.mkdir()
            try:
                rec = run_msrun(procs, work, args.steps, args.timeout)
            except (BenchError, subprocess.TimeoutExpired, OSError, psutil.Error) as exc:
                failures[row] = str(exc)
                print(f"\n{row} #{index} failed: {exc}", flush=True)
                continue
            results[row].append(rec)
            print_recovery(rec, index)
        if not args.no_msrun:
            loads[row] = meter.foreign_cores()
        print_summary(results, failures, loads)
        print(f"\n(bench took {time.monotonic() - started:.0f} s)")
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process this bench started", file=sys.stderr)
        return 130
    finally:
        clean_up(procs, root, args.keep)
        shutil.rmtree(shared_memory_root(root), ignore_errors=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
