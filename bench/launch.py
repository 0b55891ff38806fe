"""Time to first step: from the launcher's Launch to every rank's first finished step, and where it goes.

Runs the built-in example job (`trainer.examples.mlp --steps 20`, global batch 64, micro batch 32)
with 2 workers on this machine, alternately

- under trainerd: `trainerd start` on a temporary cluster file (embedded etcd, 2 local agents with
  1 CPU device each, min_nodes = max_nodes = 2, start_wait_s 0). T0 is the `generation_started`
  event (the coordinator sends the Launches right after writing it);
- under MindSpore's own `msrun` (the baseline): `msrun --worker_num=2 --local_worker_num=2 ...
  trainer/examples/mlp.py --steps 20`, with the same batch and speed-up environment (GLOG_v=3,
  MS_RETRY_INTERVAL_LOWER/UPPER=1). T0 is the moment msrun is started.

and splits each rank's time to its first step into phases, from the agents' and ranks' own logs
and each worker process's start time (/proc/<pid>/stat):

    launcher → launch at agent   trainerd: generation_started → the agent's "launching generation 1"
    → worker process spawned     trainerd: the agent forks the worker; msrun: msrun's own start-up
                                 (it imports mindspore itself) and the scheduler's spawn, then the worker's
    → import done                Python start + `import mindspore` (the rank's "joining the cluster" line)
    → communication init done    `mindspore.communication.init()`, then building data and model (tens
                                 of ms) (the rank's "training steps 1 to N" line)
    → first step done            first graph compile + step 1, including the wait for the other rank
                                 in its all-reduce (the rank's "step 1 loss" line)

Per run it prints every rank, marking with * the rank that finished communication init last (the
others wait for it in step 1's all-reduce: its phases are the critical path), and the max over the
ranks of each column (the max of the totals is the job's time to first step). Then a table of
medians over the runs, trainerd beside msrun: the last rank's phases and the job's total. Before
the first run `import mindspore` is run once, untimed, so that neither pays for a cold page cache.
Both launchers' runs alternate (and alternate which goes first) so that load from other processes
on the machine hits both alike; each run prints how many cores other processes kept busy.

    /work/main/.venv/bin/python bench/launch.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from proto.launch_env import (
    BENCH_LAUNCH_MARKER_ENV,
    GENERATION_ENV,
    GLOBAL_BATCH_ENV,
    GRAD_ACCUM_ENV,
    JOB_ENV,
    LOCAL_RANK_ENV,
    MICRO_BATCH_ENV,
    TRAINERD_ENV_PREFIX,
)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
EXAMPLE_SCRIPT = REPO / "trainer" / "examples" / "mlp.py"

WORLD_SIZE = 2
STEPS = 20
GLOBAL_BATCH = 64
MICRO_BATCH = 32
GRAD_ACCUM = GLOBAL_BATCH // (MICRO_BATCH * WORLD_SIZE)
SPEED_UP_ENV = {"GLOG_v": "3", "MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1"}
# Variables that would change how the example or MindSpore starts if this shell happened to carry them.
SCRUB_PREFIXES = ("MS_", "RANK_", TRAINERD_ENV_PREFIX, "DEVICE_ID")

PHASES = (
    ("launch_at_agent", "launcher → launch at agent"),
    ("spawned", "→ worker process spawned"),
    ("import_done", "→ import done (python + import mindspore)"),
    ("comm_done", "→ communication init done"),
    ("first_step", "→ first step done (compile + step 1)"),
)
TOTAL_LABEL = "total: launcher → first step"
SLOW_STATUS_S = 30.0  # trainerctl status period until every rank has taken its first step

LOG_TIME = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
RANK_LINES = {
    "import_done": re.compile(LOG_TIME + r" .*: rank (\d+) of \d+ joining the cluster at "),
    # "training steps 1 to N" since the example resumes from checkpoints ("training N steps" before)
    "comm_done": re.compile(LOG_TIME + r" .* rank (\d+)/\d+: training (?:\d+ steps|steps \d+ to \d+)"),
    # the first step a rank logs: step 1, or the step after the checkpoint it resumed from
    "first_step": re.compile(LOG_TIME + r" .* rank (\d+)/\d+: step \d+ loss "),
}
AGENT_LAUNCH_LINE = re.compile(LOG_TIME + r" .*launching generation 1 of job ")


class BenchError(RuntimeError):
    """A run could not be measured; the message says why."""


# ---------------------------------------------------------------- processes

class Processes:
    """Everything this bench starts: each in its own process group and carrying a marker variable,
    so that at exit every group and every descendant (agents, workers, etcd, which live in process
    groups of their own) can be found and killed."""

    def __init__(self) -> None:
        self.marker = f"{os.getpid()}-{uuid.uuid4().hex}"
        self._popens: list[subprocess.Popen] = []

    def start(self, argv: list[str], log_path: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen:
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=cwd, env={**env, BENCH_LAUNCH_MARKER_ENV: self.marker}, start_new_session=True)
        self._popens.append(popen)
        return popen

    def marked(self) -> list[int]:
        """Live processes that carry this bench's marker."""
        return [pid for pid, env in _proc_environs() if env.get(BENCH_LAUNCH_MARKER_ENV) == self.marker]

    def kill_all(self) -> None:
        own_group = os.getpgrp()
        for popen in self._popens:
            if popen.poll() is None:
                _killpg(popen.pid, own_group)
        for _ in range(3):
            pids = self.marked()
            if not pids:
                break
            for pid in pids:
                try:
                    _killpg(os.getpgid(pid), own_group)
                except ProcessLookupError:
                    pass
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        for popen in self._popens:
            try:
                popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._popens.clear()


def _killpg(pgid: int, own_group: int) -> None:
    if pgid == own_group:
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _proc_environs():
    """(pid, environment at exec) of every process of this user whose environment is readable."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        env = {}
        for item in raw.split(b"\0"):
            key, sep, value = item.partition(b"=")
            if sep:
                env[key.decode(errors="replace")] = value.decode(errors="replace")
        yield int(entry), env


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_start_wall(pid: int) -> float:
    """Wall-clock time at which `pid` was created (10 ms resolution). psutil's create_time rounds the
    boot time to whole seconds; /proc/uptime gives it to the centisecond."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    start_ticks = int(stat[stat.rindex(")") + 2:].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - uptime + start_ticks / _CLOCK_TICKS


class WorkerSpawns:
    """Finds this bench's worker processes while they run and notes when each was created."""

    def __init__(self, marker: str) -> None:
        self._marker = marker
        self.by_rank: dict[int, float] = {}
        self._found: set[int] = set()

    def complete(self) -> bool:
        return len(self.by_rank) >= WORLD_SIZE

    def scan(self) -> None:
        # No negative cache: a child between fork and exec still shows its parent's command line.
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in self._found:
                continue
            pid = int(entry)
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
                if b"mlp" not in cmdline:
                    continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = dict(item.partition(b"=")[::2] for item in f.read().split(b"\0") if item)
                if (environ.get(BENCH_LAUNCH_MARKER_ENV.encode()) != self._marker.encode()
                        or environ.get(b"MS_ROLE") != b"MS_WORKER"):
                    continue
                self.by_rank[int(environ[b"RANK_ID"])] = process_start_wall(pid)
                self._found.add(pid)
            except (OSError, KeyError, ValueError):
                continue


class CpuMeter:
    """CPU that processes other than this bench and its descendants used during a run, in cores.

    Busy time of the whole machine (/proc/stat) minus this process's and its reaped descendants'
    (trainerd reaps its agents and etcd, the agents their workers, msrun its workers)."""

    def __init__(self) -> None:
        self._start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / _CLOCK_TICKS  # all but idle and iowait
        own = sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
                  for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        return time.monotonic(), busy, own

    def foreign_cores(self) -> float:
        t1, busy1, own1 = self._read()
        t0, busy0, own0 = self._start
        return max(0.0, ((busy1 - busy0) - (own1 - own0)) / max(t1 - t0, 1e-6))


# ---------------------------------------------------------------- parsing

def log_time(stamp: str) -> float:
    """A Python logging asctime (local time, milliseconds) as unix seconds."""
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def rank_marks(log_path: Path) -> dict[str, float]:
    """The three marks of one rank's log: import done, communication init done, first step done."""
    marks: dict[str, float] = {}
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    for line in text.splitlines():
        for name, pattern in RANK_LINES.items():
            match = pattern.search(line)
            if match and name not in marks:
                marks[name] = log_time(match.group(1))
    return marks


@dataclass
class RankTimes:
    """Absolute unix times of one rank's milestones; None where the launcher has no such moment."""

    rank: int
    launch_at_agent: float | None
    spawned: float | None
    import_done: float
    comm_done: float
    first_step: float

    def phases(self, t0: float) -> dict[str, float | None]:
        """Seconds spent in each phase; a phase with no mark is folded into the next one."""
        out: dict[str, float | None] = {}
        previous = t0
        for key, _ in PHASES:
            mark = getattr(self, key)
            if mark is None:
                out[key] = None
                continue
            out[key] = mark - previous
            previous = mark
        out["total"] = self.first_step - t0
        return out


@dataclass
class Run:
    launcher: str
    t0: float
    ranks: list[RankTimes]
    foreign_cores: float
    notes: list[str] = field(default_factory=list)

    def per_rank(self) -> list[tuple[int, dict[str, float | None]]]:
        return [(r.rank, r.phases(self.t0)) for r in sorted(self.ranks, key=lambda r: r.rank)]

    def worst(self) -> dict[str, float | None]:
        """Max over ranks of every phase (the total's max is the job's time to first step)."""
        rows = [phases for _, phases in self.per_rank()]
        return {key: (None if any(row[key] is None for row in rows) else max(row[key] for row in rows))
                for key in [k for k, _ in PHASES] + ["total"]}

    def last_rank(self) -> RankTimes:
        """The rank that finished communication init last: every other rank waits for it in step 1's
        all-reduce, so its phases are the job's critical path."""
        return max(self.ranks, key=lambda r: r.comm_done)


def require_marks(where: str, marks: dict[str, float], log_path: Path) -> None:
    missing = [name for name in RANK_LINES if name not in marks]
    if missing:
        raise BenchError(f"{where}: no {', '.join(missing)} line in {log_path}:\n{tail(log_path)}")


def tail(path: Path, lines: int = 15) -> str:
    if not path.exists():
        return f"    ({path} does not exist)"
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join("    " + line for line in text)


# ---------------------------------------------------------------- the two launchers

def free_ports(count: int) -> list[int]:
    """`count` distinct ports that were free a moment ago (all bound at once, then released)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB_PREFIXES)}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def trainerctl(coordinator: str, *args: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "trainerctl"), "--coordinator", coordinator, *args],
                          capture_output=True, text=True, timeout=timeout, env=clean_env())


def job_state(coordinator: str) -> dict | None:
    try:
        result = trainerctl(coordinator, "status", "-o", "json")
    except subprocess.TimeoutExpired:
        return None
    if result.returncode != 0:
        return None
    return json.loads(result.stdout).get("job")


def run_trainerd(procs: Processes, root: Path, timeout_s: float) -> Run:
    coordinator_port, etcd_client, etcd_peer, scheduler_gen1 = free_ports(4)
    coordinator = f"127.0.0.1:{coordinator_port}"
    cluster_name = "bench"
    cluster = {  # JSON is YAML
        "cluster": {
            "name": cluster_name,
            "coordinator": {"listen": coordinator},
            "etcd": {"endpoints": [], "data_dir": "etcd", "client_listen": f"127.0.0.1:{etcd_client}",
                     "peer_listen": f"127.0.0.1:{etcd_peer}"},
            "heartbeat": {"interval_s": 1.0, "timeout_s": 5.0},
            "local_agents": WORLD_SIZE,
            "local_agent": {"work_dir": "agents", "cpu_devices": 1},
        },
        "job": {
            "name": "mlp-bench",
            "entrypoint": ["{python}", "-m", "trainer.examples.mlp", "--steps", str(STEPS)],
            "devices_per_node": 1, "min_nodes": WORLD_SIZE, "max_nodes": WORLD_SIZE,
            "global_batch": GLOBAL_BATCH, "micro_batch": MICRO_BATCH,
            # generation g uses scheduler_port + g % 16: generation 1 gets the free port found above
            "scheduler_port": scheduler_gen1 - 1,
            "start_wait_s": 0, "stop_grace_s": 5,
        },
    }
    cluster_file = root / "cluster.yaml"
    cluster_file.write_text(json.dumps(cluster, indent=2))
    agent_dirs = [root / "agents" / f"{cluster_name}-local-{i}" for i in range(WORLD_SIZE)]
    trainerd_log = root / "trainerd.log"
    env = {**clean_env(), **SPEED_UP_ENV}

    meter = CpuMeter()
    started_wall = time.time()
    trainerd = procs.start([str(BIN / "trainerd"), "start", "--cluster", str(cluster_file)], trainerd_log, env, root)
    spawns = WorkerSpawns(procs.marker)
    deadline = time.monotonic() + timeout_s
    next_status, state, first_steps_seen = time.monotonic() + SLOW_STATUS_S, None, False
    try:
        while True:
            now = time.monotonic()
            if now > deadline:
                raise BenchError(f"trainerd: job not COMPLETED within {timeout_s:.0f} s (last state {state})\n"
                                 f"{tail(trainerd_log)}")
            if trainerd.poll() is not None:
                raise BenchError(f"trainerd exited early with code {trainerd.returncode}:\n{tail(trainerd_log)}")
            if not spawns.complete():
                spawns.scan()
            if not first_steps_seen:
                logs = list(root.glob("agents/*/generations/000001/rank*.log"))
                first_steps_seen = len(logs) == WORLD_SIZE and all(
                    "first_step" in rank_marks(p) for p in logs)
                if first_steps_seen:
                    next_status = now
            # trainerctl is a Python process of its own (about 0.4 s of CPU): ask rarely while the ranks
            # start up, where it would compete with them for the cores (msrun's run has no such
            # poller), every second once they have all taken their first step.
            if now >= next_status:
                job = job_state(coordinator)
                state = job["state"] if job else state
                if state == "COMPLETED":
                    break
                if state == "FAILED":
                    raise BenchError(f"trainerd: the job FAILED: {job.get('last_failure')}")
                next_status = time.monotonic() + (1.0 if first_steps_seen else SLOW_STATUS_S)
            time.sleep(0.1 if not spawns.complete() else 0.5)
        events = [json.loads(line) for line in trainerctl(coordinator, "events", "-o", "json").stdout.splitlines()
                  if line.strip()]
    finally:
        trainerd.send_signal(signal.SIGTERM)
        try:
            trainerd.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        procs.kill_all()
    foreign = meter.foreign_cores()  # only now: trainerd has reaped its agents and etcd, they theirs

    launches = [e for e in events if e["kind"] == "generation_started"]
    first = [e for e in launches if e.get("fields", {}).get("generation") == 1]
    if not first:
        raise BenchError(f"trainerd: no generation_started event for generation 1 in {events}")
    t0 = float(first[0]["at"])
    run = Run("trainerd", t0, [], foreign)
    run.notes.append(f"trainerd start → Launch {t0 - started_wall:.2f} s (etcd, leader election, agents joining)")
    if len(launches) > 1:
        run.notes.append(f"{len(launches)} generations were started: the job restarted, the run is disturbed")

    for agent_dir in agent_dirs:
        agent_log = agent_dir / "agent.log"
        match = AGENT_LAUNCH_LINE.search(agent_log.read_text(errors="replace")) if agent_log.exists() else None
        if match is None:
            raise BenchError(f"trainerd: no 'launching generation 1' line in {agent_log}:\n{tail(agent_log)}")
        received = log_time(match.group(1))
        for rank_log in sorted((agent_dir / "generations" / "000001").glob("rank*.log")):
            rank = int(rank_log.stem.removeprefix("rank"))
            marks = rank_marks(rank_log)
            require_marks(f"trainerd rank {rank}", marks, rank_log)
            run.ranks.append(RankTimes(rank, received, spawns.by_rank.get(rank), **marks))
    if len(run.ranks) != WORLD_SIZE:
        raise BenchError(f"trainerd: found {len(run.ranks)} rank logs, expected {WORLD_SIZE}")
    return run


def msrun_env() -> dict[str, str]:
    """The environment the example job needs under msrun, with the batch split trainerd would hand it."""
    return {
        **clean_env(), **SPEED_UP_ENV,
        # The example's rank context asks a cluster launch for trainerd's variables too. msrun hands
        # all its children one environment, so TRAINERD_LOCAL_RANK is 0 for both workers: the example
        # only stores it (RankContext.local_rank), nothing reads it.
        JOB_ENV: "mlp-msrun", GENERATION_ENV: "1", LOCAL_RANK_ENV: "0",
        # the batch split trainerd hands its ranks, so that both launchers run the same steps
        GLOBAL_BATCH_ENV: str(GLOBAL_BATCH), MICRO_BATCH_ENV: str(MICRO_BATCH),
        GRAD_ACCUM_ENV: str(GRAD_ACCUM),
    }


def msrun_argv(master_port: int, log_dir: Path, cluster_time_out_s: float, script_args: list[str]) -> list[str]:
    """msrun running the example job on WORLD_SIZE local workers."""
    return [str(BIN / "msrun"), f"--worker_num={WORLD_SIZE}", f"--local_worker_num={WORLD_SIZE}",
            "--master_addr=127.0.0.1", f"--master_port={master_port}", f"--log_dir={log_dir}", "--join=True",
            f"--cluster_time_out={int(cluster_time_out_s)}", str(EXAMPLE_SCRIPT), *script_args]


def run_msrun(procs: Processes, root: Path, timeout_s: float) -> Run:
    (master_port,) = free_ports(1)
    log_dir = root / "msrun_logs"
    env = msrun_env()
    argv = msrun_argv(master_port, log_dir, timeout_s, ["--steps", str(STEPS)])
    msrun_log = root / "msrun.log"
    meter = CpuMeter()
    spawns = WorkerSpawns(procs.marker)
    t0 = time.time()
    msrun = procs.start(argv, msrun_log, env, root)
    deadline = time.monotonic() + timeout_s
    try:
        while msrun.poll() is None:
            if time.monotonic() > deadline:
                raise BenchError(f"msrun: not finished within {timeout_s:.0f} s\n{tail(msrun_log)}")
            if not spawns.complete():
                spawns.scan()
            time.sleep(0.1 if not spawns.complete() else 0.5)
        foreign = meter.foreign_cores()
    finally:
        procs.kill_all()
    if msrun.returncode != 0:
        logs = "\n".join(f"  {p.name}:\n{tail(p)}" for p in sorted(log_dir.glob("*.log")))
        raise BenchError(f"msrun exited with code {msrun.returncode}:\n  msrun.log:\n{tail(msrun_log)}\n{logs}")
    run = Run("msrun", t0, [], foreign)
    for rank in range(WORLD_SIZE):
        worker_log = log_dir / f"worker_{rank}.log"
        marks = rank_marks(worker_log)
        require_marks(f"msrun worker {rank}", marks, worker_log)
        run.ranks.append(RankTimes(rank, None, spawns.by_rank.get(rank), **marks))
    return run


# ---------------------------------------------------------------- output

def fmt(value: float | None) -> str:
    if value is None:
        return "—"
    # a process's start time is truncated to 10 ms ticks, log lines to 1 ms: -0.00 is 0.00
    return f"{max(value, 0.0) if value > -0.02 else value:.2f} s"


def print_run(run: Run, index: int) -> None:
    keys = [k for k, _ in PHASES] + ["total"]
    headers = ["at agent", "spawned", "imported", "comm init", "step 1", "total"]
    print(f"\n{run.launcher} run {index}: other processes kept {run.foreign_cores:.2f} of "
          f"{os.cpu_count()} cores busy on average")
    print(f"  {'':8}" + "".join(f"{h:>11}" for h in headers))
    last = run.last_rank().rank
    for rank, phases in run.per_rank():
        label = f"rank {rank}" + (" *" if rank == last else "")
        print(f"  {label:<8}" + "".join(f"{fmt(phases[k]):>11}" for k in keys))
    worst = run.worst()
    print(f"  {'max':8}" + "".join(f"{fmt(worst[k]):>11}" for k in keys))
    for note in run.notes:
        print(f"  {note}")


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present and len(present) == len(values) else None


def print_summary(runs: dict[str, list[Run]], failures: dict[str, str]) -> None:
    launchers = ("trainerd", "msrun")
    columns = {name: [run.worst() for run in runs[name]] for name in launchers}
    critical = {name: [run.last_rank().phases(run.t0) for run in runs[name]] for name in launchers}
    rows = [(key, label, critical) for key, label in PHASES] + [("total", TOTAL_LABEL, columns)]
    label_width = max(len(label) for _, label, _ in rows) + 2
    print("\nMedians over the runs. Phases: of the rank that finished communication init last (* above; the"
          "\nother waits for it in step 1's all-reduce). Total: max over the ranks, the job's time to first step.")
    print(f"{'phase':<{label_width}}" + "".join(f"{name + ' median':>18}" for name in launchers))
    for key, label, source in rows:
        cells = []
        for name in launchers:
            if name in failures and not source[name]:
                cells.append("failed")
            else:
                cells.append(fmt(median([row[key] for row in source[name]])) if source[name] else "—")
        print(f"{label:<{label_width}}" + "".join(f"{cell:>18}" for cell in cells))
    for name in launchers:
        totals = ", ".join(fmt(row["total"]) for row in columns[name]) or "none"
        foreign = ", ".join(f"{run.foreign_cores:.2f}" for run in runs[name]) or "-"
        print(f"{name} runs, time to first step: {totals}  (other load in cores: {foreign})")
    if columns["trainerd"] and columns["msrun"]:
        t, m = median([r["total"] for r in columns["trainerd"]]), median([r["total"] for r in columns["msrun"]])
        if t and m:
            print(f"trainerd / msrun time to first step: {t / m:.2f}")
    print("msrun's first two phases are one: msrun's own start-up (Python + import mindspore) and its"
          " spawning of the scheduler and workers.")
    for name, reason in failures.items():
        print(f"\n{name} could not be measured: {reason}")


# ---------------------------------------------------------------- main

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each launcher, alternating which goes first (default 3)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take (default 300)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory with every log")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed `import mindspore`")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    interrupt_on_signals()

    root = Path(tempfile.mkdtemp(prefix="trainerd-bench-launch-"))
    procs = Processes()
    runs: dict[str, list[Run]] = {"trainerd": [], "msrun": []}
    failures: dict[str, str] = {}
    print(f"example job: {WORLD_SIZE} workers x 1 CPU device, {STEPS} steps, global batch {GLOBAL_BATCH}, "
          f"micro batch {MICRO_BATCH}; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start",
          flush=True)
    try:
        if not args.no_warmup:
            subprocess.run([sys.executable, "-c", "import mindspore"], env=clean_env(), timeout=120,
                           capture_output=True, check=False)
        order = [("trainerd", run_trainerd), ("msrun", run_msrun)]
        for index in range(1, args.repeats + 1):
            for name, runner in order if index % 2 else order[::-1]:  # alternate who goes first
                if name in failures and not runs[name]:
                    continue  # it failed before it ever ran: do not retry it every repeat
                work = root / f"{name}-{index}"
                work.mkdir()
                try:
                    run = runner(procs, work, args.timeout)
                except (BenchError, subprocess.TimeoutExpired, OSError) as exc:
                    failures[name] = str(exc)
                    print(f"\n{name} run {index} failed: {exc}", flush=True)
                    continue
                runs[name].append(run)
                print_run(run, index)
                sys.stdout.flush()
        print_summary(runs, failures)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process this bench started", file=sys.stderr)
        return 130
    finally:
        clean_up(procs, root, args.keep)
    return 0 if not failures else 1


def _interrupt(signum: int, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def interrupt_on_signals() -> None:
    """Ctrl-C, SIGTERM and SIGHUP (also when a shell started the bench in the background, ignoring
    SIGINT there) interrupt the bench, so its clean-up runs."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)


def clean_up(procs, root: Path, keep: bool) -> None:
    """Stop every process the bench started (a second Ctrl-C cannot cut this short); keep or remove its files."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    procs.kill_all()
    if keep:
        print(f"\nlogs kept under {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
