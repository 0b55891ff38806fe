"""What in-memory snapshots cost a running job's CPU: the built-in example (`trainer.examples.mlp`) on two agents
of one rank each (so each agent also copies its ring predecessor's snapshots), run to the end with
`checkpoint.memory_every_steps` at each value asked for, beside the same job with snapshots off (0) in the
same run.

Columns, per interval:

    wall        seconds from trainerd's start to COMPLETED
    ranks       CPU-seconds of the two training processes (from their fork or start to their exit)
    agents      CPU-seconds of the two agents themselves (not their templates or workers)

The CPU is read from /proc every 0.1 s for every process of the run (a process's last 0.1 s may be missed).

    python bench/snapshot_cost.py [--steps 1500] [--intervals 0,10,auto]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.launch import BenchError, Processes, clean_up, interrupt_on_signals  # noqa: E402
from bench.recovery import TrainerdCluster, become_subreaper, shared_memory_root, status  # noqa: E402


def cpu_by_kind(seen: dict[tuple[int, float], tuple[str, float]]) -> None:
    """Add every live process of this bench's tree to `seen`: (pid, start time) -> (kind, CPU-seconds so far)."""
    for process in psutil.Process().children(recursive=True):
        try:
            with process.oneshot():
                command = " ".join(process.cmdline())
                times = process.cpu_times()
                key = (process.pid, process.create_time())
        except psutil.Error:
            continue
        kind = "ranks" if "trainer.examples.mlp" in command else "agents" if "trainerd-agent" in command else ""
        if kind:
            seen[key] = (kind, times.user + times.system)


def run(procs: Processes, root: Path, interval: str, steps: int, timeout_s: float) -> tuple[float, float, float]:
    """(wall seconds to COMPLETED, the ranks' CPU-seconds, the agents' CPU-seconds) of one run."""
    started = time.monotonic()
    cluster = TrainerdCluster(procs, root, nodes=2, steps=steps, timeout_s=timeout_s, memory_every=interval)
    seen: dict[tuple[int, float], tuple[str, float]] = {}
    try:
        while True:
            cpu_by_kind(seen)
            job = (status(cluster.coordinator) or {}).get("job")
            if job is not None and job["state"] in ("COMPLETED", "FAILED"):
                break
            if time.monotonic() - started > timeout_s:
                raise BenchError(f"the job with memory_every_steps {interval} did not end in {timeout_s:g} s")
            time.sleep(0.1)
        if job["state"] != "COMPLETED":
            raise BenchError(f"the job with memory_every_steps {interval} ended {job['state']}")
        wall = time.monotonic() - started
        cpu_by_kind(seen)
    finally:
        cluster.stop()
    return (wall, sum(t for kind, t in seen.values() if kind == "ranks"),
            sum(t for kind, t in seen.values() if kind == "agents"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1500, help="training steps of each run (default 1500)")
    parser.add_argument("--intervals", default="0,10,auto",
                        help="memory_every_steps values, comma-separated (default 0,10,auto; 0 is the baseline)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take (default 300)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory with every log")
    args = parser.parse_args()
    intervals = [i.strip() for i in args.intervals.split(",") if i.strip()]
    if args.steps < 1 or not intervals or not all(i == "auto" or i.isdigit() for i in intervals):
        parser.error("--steps must be at least 1 and --intervals a list of step counts or auto")
    interrupt_on_signals()
    become_subreaper()
    root = Path(tempfile.mkdtemp(prefix="trainerd-bench-snapshots-"))
    procs = Processes()
    print(f"the MLP example, {args.steps} steps on 2 agents of 1 rank each; {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f} at start", flush=True)
    print(f"{'memory_every_steps':>18} {'wall (s)':>9} {'ranks (CPU-s)':>14} {'agents (CPU-s)':>15}", flush=True)
    try:
        for interval in intervals:
            work = root / f"every-{interval}"
            work.mkdir()
            wall, ranks, agents = run(procs, work, interval, args.steps, args.timeout)
            print(f"{interval:>18} {wall:>9.1f} {ranks:>14.1f} {agents:>15.1f}", flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process this bench started", file=sys.stderr)
        return 130
    except BenchError as exc:
        print(f"\nfailed: {exc}", file=sys.stderr)
        return 1
    finally:
        clean_up(procs, root, args.keep)
        shutil.rmtree(shared_memory_root(root), ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
