"""`make demo` (`.venv/bin/python scripts/demo.py`): the whole system on one machine.

Starts `trainerd` on configs/cluster.demo.yaml (embedded etcd, two local agents, the MindSpore
example job), and once the job has saved a checkpoint, SIGKILLs one of its workers, as a crash
would. trainerd stops the generation, relaunches it from the newest checkpoint and the job goes on
to COMPLETED. The demo follows the job with `trainerctl status` until it ends, prints the final
status (with the recovery's phases) and the event log, and shuts trainerd down. Everything it
writes is under run/demo/ of the repository, wherever it is started from. It drives trainerd and
trainerctl as an operator would, through the commands installed beside the interpreter, and imports
nothing from the repository.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN_DIR = REPO / "run" / "demo"
BIN = Path(sys.executable).parent
COORDINATOR = "127.0.0.1:17420"
TIMEOUT_S = 600
CRASH_AFTER_CHECKPOINT_STEP = 200


def trainerctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "trainerctl"), "--coordinator", COORDINATOR, *args],
                          capture_output=True, text=True, timeout=30)


def job_status() -> dict | None:
    result = trainerctl("status", "-o", "json")
    return json.loads(result.stdout)["job"] if result.returncode == 0 else None


def worker_pid(rank: int) -> int | None:
    """The PID of a running worker of `rank`, from the process registries the agents keep."""
    for registry in RUN_DIR.glob("agents/*/processes.json"):
        try:
            pids = [int(pid) for pid in json.loads(registry.read_text())]
        except (OSError, ValueError):
            continue
        for pid in pids:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"MS_ROLE=MS_WORKER" in environ and f"RANK_ID={rank}".encode() in environ:
                return pid
    return None


def main() -> int:
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    RUN_DIR.mkdir(parents=True)
    cluster_file = RUN_DIR / "cluster.yaml"
    shutil.copy(REPO / "configs" / "cluster.demo.yaml", cluster_file)
    log_path = RUN_DIR / "trainerd.log"
    print(f"starting trainerd (log: {log_path.relative_to(REPO)})", flush=True)
    with open(log_path, "wb") as log:
        trainerd = subprocess.Popen([str(BIN / "trainerd"), "start", "--cluster", str(cluster_file)],
                                    stdout=log, stderr=subprocess.STDOUT)
    state, last_line, deadline = None, "", time.monotonic() + TIMEOUT_S
    crashed = False
    try:
        while time.monotonic() < deadline:
            if trainerd.poll() is not None:
                print(f"trainerd exited early with code {trainerd.returncode}; see {log_path}", file=sys.stderr)
                return 1
            job = job_status()
            if job is not None:
                state = job["state"]
                line = (f"job {job['name']}: {state:<10} generation {job['generation']}  world size "
                        f"{job['world_size']}  step {job['step']}  loss "
                        f"{'-' if job['loss'] is None else format(job['loss'], '.4f')}")
                if line != last_line:
                    print(line, flush=True)
                    last_line = line
                if state in ("COMPLETED", "FAILED"):
                    break
                if not crashed and (job["last_checkpoint_step"] or 0) >= CRASH_AFTER_CHECKPOINT_STEP:
                    pid = worker_pid(1)
                    if pid is not None:
                        print(f"--- demo: SIGKILL rank 1 (pid {pid}), as a crash would; trainerd recovers "
                              f"from the checkpoint at step {job['last_checkpoint_step']} or later", flush=True)
                        os.kill(pid, signal.SIGKILL)
                        crashed = True
            time.sleep(1.0)
        print()
        print(trainerctl("status").stdout)
        print(trainerctl("events").stdout)
    finally:
        trainerd.send_signal(signal.SIGTERM)
        trainerd.wait(timeout=60)
    print(f"logs of every process are under {RUN_DIR.relative_to(REPO)}/agents/*/generations/")
    return 0 if state == "COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(main())
