"""What `trainerctl pause` and `resume` cost a running job: the steps the resume trains again, and how long
the pause takes, beside `trainerctl pause --now` (stop at once, the resume goes back to the newest periodic
checkpoint) in the same run.

The job is bench/recovery.py's: the built-in example (`trainer.examples.mlp`) on one agent with 2 CPU
devices, a disk checkpoint every 100 steps, in-memory snapshots off (so that only the disk checkpoints
count). Each pause lands --repeats times per way, each time 30 to 70 steps past a periodic checkpoint
(where an operator's pause lands on average); after PAUSED the job is resumed and runs until RUNNING.

Columns, per pause:

    at step        the step status showed when the pause was asked for (it trails the ranks by up to a
                   progress report, 0.5 s: at this job's ~100 steps a second, up to ~50 steps)
    to PAUSED      seconds from the `trainerctl pause` command to status showing PAUSED
    resumed from   the checkpoint step the resume started at (last_recovery.resumed_from_step)
    redone         steps trained again after the resume (last_recovery.lost_steps: the furthest step the
                   paused generation reached minus the step resumed from)

    python bench/pause.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.launch import BenchError, Processes, clean_up, interrupt_on_signals, trainerctl  # noqa: E402
from bench.recovery import (  # noqa: E402
    CHECKPOINT_EVERY,
    DEFAULT_STEPS,
    TrainerdCluster,
    become_subreaper,
    shared_memory_root,
)
from tests.waiting import wait_until  # noqa: E402

WAYS = {"pause": (), "pause --now": ("--now",)}
LANDING = (30, 70)  # steps past a periodic checkpoint where the pause is asked for


def pause_once(cluster: TrainerdCluster, flags: tuple[str, ...], timeout_s: float) -> tuple[int, float, int, int]:
    """(step at the pause, seconds to PAUSED, step resumed from, steps redone) of one pause and resume."""
    job = wait_until(lambda: (j := cluster.job()) and j["state"] == "RUNNING" and j["step"] is not None
                     and j["step"] > CHECKPOINT_EVERY and LANDING[0] <= j["step"] % CHECKPOINT_EVERY <= LANDING[1]
                     and j, timeout_s, "the job 30 to 70 steps past a checkpoint", interval=0.05)
    generation, at_step = job["generation"], int(job["step"])
    asked = time.monotonic()
    result = trainerctl(cluster.coordinator, "pause", *flags)
    if result.returncode != 0:
        raise BenchError(f"trainerctl pause {' '.join(flags)} failed: {result.stderr.strip()}")
    wait_until(lambda: (j := cluster.job()) and j["state"] == "PAUSED", timeout_s, "PAUSED", interval=0.05)
    to_paused = time.monotonic() - asked
    result = trainerctl(cluster.coordinator, "resume")
    if result.returncode != 0:
        raise BenchError(f"trainerctl resume failed: {result.stderr.strip()}")
    job = wait_until(lambda: (j := cluster.job()) and j["state"] == "RUNNING" and j["generation"] > generation
                     and j, timeout_s, "RUNNING again", interval=0.2)
    recovery = job["last_recovery"]
    return at_step, to_paused, recovery["resumed_from_step"], recovery["lost_steps"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="pauses of each way (default 3)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any one wait may take (default 120)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory with every log")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    interrupt_on_signals()
    become_subreaper()
    root = Path(tempfile.mkdtemp(prefix="trainerd-bench-pause-"))
    procs = Processes()
    print(f"example job: 2 ranks on one agent, a checkpoint every {CHECKPOINT_EVERY} steps, in-memory snapshots off; "
          f"{args.repeats} pause(s) each way, {LANDING[0]}-{LANDING[1]} steps past a checkpoint; {os.cpu_count()} "
          f"cores, load average {os.getloadavg()[0]:.2f} at start", flush=True)
    results: dict[str, list[tuple[int, float, int, int]]] = {way: [] for way in WAYS}
    try:
        for way, flags in WAYS.items():
            work = root / way.replace(" ", "").replace("-", "")
            work.mkdir()
            cluster = TrainerdCluster(procs, work, nodes=1, steps=DEFAULT_STEPS, timeout_s=args.timeout,
                                      one_host=True, memory_every="0")
            try:
                for index in range(1, args.repeats + 1):
                    row = pause_once(cluster, flags, args.timeout)
                    results[way].append(row)
                    print(f"{way:<12} #{index}: at step {row[0]}, PAUSED after {row[1]:.2f} s, resumed from step "
                          f"{row[2]}, {row[3]} step(s) redone", flush=True)
            finally:
                cluster.stop()
        print(f"\n{'':<12} {'to PAUSED (s), median':>22} {'steps redone, median (max)':>28}")
        for way, rows in results.items():
            print(f"{way:<12} {statistics.median(r[1] for r in rows):>22.2f} "
                  f"{statistics.median(r[3] for r in rows):>20g} ({max(r[3] for r in rows)})")
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
