"""`make demo`: the whole system on one machine.

Starts `trainerd` on configs/cluster.demo.yaml (embedded etcd, two local agents, the MindSpore
example job), follows the job with `trainerctl status` until it ends, prints the final status and
the event log, and shuts trainerd down. Everything it writes is under run/demo/.
"""

from __future__ import annotations

import json
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


def trainerctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "trainerctl"), "--coordinator", COORDINATOR, *args],
                          capture_output=True, text=True, timeout=30)


def job_status() -> dict | None:
    result = trainerctl("status", "-o", "json")
    return json.loads(result.stdout)["job"] if result.returncode == 0 else None


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
