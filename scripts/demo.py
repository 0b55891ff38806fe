"""`make demo` (`.venv/bin/python scripts/demo.py`): the whole system on one machine, in a few minutes.

Starts `trainerd` on configs/cluster.demo.yaml: embedded etcd, three local agents, and the Transformer
example job (trainer/examples/transformer_lm.py, Model.train with TrainerdCallback) on all three, one
batch of which is NaN. Then, as the job goes on:
- the NaN batch (step 60) is skipped inside the step on every rank and lands in the skip ledger;
- once a checkpoint is saved, one worker is SIGKILLed, as a crash would: trainerd relaunches the
  generation from the newest in-memory snapshot the agents hold (or the newest checkpoint, when newer);
- later a whole host is lost: its agent and its workers are SIGKILLed; trainerd declares the node lost
  and resumes on the two hosts left, from the snapshot whose lost ranks survive in the copies the next
  host's agent made of them, resharded from 3 ranks to 2;
- the host's agent is started again: trainerd asks the job for a checkpoint and grows it back to 3;
- the job completes.
The demo follows the job with `trainerctl status` and ends by printing the final status, the event log and
the skip ledger, then shuts trainerd down. Everything it writes is under run/demo/ of the repository,
wherever it is started from. It drives trainerd, trainerd-agent and trainerctl as an operator would,
through the commands installed beside the interpreter, and imports nothing from the repository.
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
TIMEOUT_S = 780  # below the 900 s a caller may give `timeout`: trainerd is always shut down
CRASH_AFTER_CHECKPOINT_STEP = 100  # kill a worker once this checkpoint is saved
HOST_LOST_AFTER_CHECKPOINT_STEP = 200  # then lose a host once the relaunched job saved this one
HOST_BACK_AFTER_STEPS = 50  # and start its agent again once the shrunk job has run this many steps
LOST_HOST = "demo-local-2"


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


def kill_host(node: str) -> None:
    """SIGKILL the local agent of `node` and every process group it started, as a host going down would."""
    for pid in Path("/proc").iterdir():
        try:
            cmdline = (pid / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"agent.main" in cmdline and node.encode() in cmdline:
            os.kill(int(pid.name), signal.SIGKILL)
    try:
        groups = [int(pid) for pid in json.loads((RUN_DIR / "agents" / node / "processes.json").read_text())]
    except (OSError, ValueError):
        groups = []
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_agent(node: str) -> subprocess.Popen:
    """The agent of `node` started again, as trainerd starts its local agents (same work directory and log)."""
    work_dir = RUN_DIR / "agents" / node
    with open(work_dir / "agent.log", "ab") as log:
        return subprocess.Popen([str(BIN / "trainerd-agent"), "--coordinator", COORDINATOR, "--node-name", node,
                                 "--cpu-devices", "1", "--work-dir", str(work_dir)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


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
    crashed, lost_at, returned = False, None, None
    skipped = 0
    try:
        while time.monotonic() < deadline:
            if trainerd.poll() is not None:
                print(f"trainerd exited early with code {trainerd.returncode}; see {log_path}", file=sys.stderr)
                return 1
            job = job_status()
            if job is not None:
                state = job["state"]
                line = (f"job {job['name']}: {state:<10} generation {job['generation']}  world size "
                        f"{job['world_size']}  step {'-' if job['step'] is None else job['step']}  loss "
                        f"{'-' if job['loss'] is None else format(job['loss'], '.4f')}  checkpoint "
                        f"{job['last_checkpoint_step'] or '-'}  skipped ranges {job['skipped_batches']}")
                if line != last_line:
                    print(line, flush=True)
                    last_line = line
                if job["skipped_batches"] > skipped:
                    skipped = job["skipped_batches"]
                    print("--- demo: the NaN batch of step 60 was skipped inside the step on every rank, and its "
                          "samples went into the skip ledger", flush=True)
                if state in ("COMPLETED", "FAILED"):
                    break
                checkpoint, step = job["last_checkpoint_step"] or 0, job["step"] or 0
                if crashed and lost_at is None and job["generation"] >= 2 and state == "RUNNING" and \
                        checkpoint >= HOST_LOST_AFTER_CHECKPOINT_STEP:
                    print(f"--- demo: host {LOST_HOST} lost (its agent and workers SIGKILLed); trainerd resumes on "
                          f"the 2 hosts left from the in-memory snapshot the others hold of its ranks (or the "
                          f"checkpoint at step {checkpoint}), resharded", flush=True)
                    kill_host(LOST_HOST)
                    lost_at = job["generation"]
                if lost_at is not None and returned is None and job["generation"] > lost_at and \
                        job["world_size"] == 2 and state == "RUNNING" and \
                        step >= (job["last_recovery"] or {}).get("resumed_from_step", 0) + HOST_BACK_AFTER_STEPS:
                    print(f"--- demo: host {LOST_HOST} is back (its agent started again); trainerd grows the job "
                          f"to 3 at a checkpoint", flush=True)
                    returned = start_agent(LOST_HOST)
                if not crashed and checkpoint >= CRASH_AFTER_CHECKPOINT_STEP:
                    pid = worker_pid(1)
                    if pid is not None:
                        print(f"--- demo: SIGKILL rank 1 (pid {pid}), as a crash would; trainerd recovers "
                              f"from the newest in-memory snapshot (or the checkpoint at step "
                              f"{job['last_checkpoint_step']})", flush=True)
                        os.kill(pid, signal.SIGKILL)
                        crashed = True
            time.sleep(1.0)
        print()
        print(trainerctl("status").stdout)
        print(trainerctl("events").stdout)
        print(trainerctl("skips").stdout)
    finally:
        trainerd.send_signal(signal.SIGTERM)
        trainerd.wait(timeout=60)
        if returned is not None:  # trainerd stops the agents it started; this one is the demo's
            returned.send_signal(signal.SIGTERM)
            returned.wait(timeout=30)
    print(f"logs of every process are under {RUN_DIR.relative_to(REPO)}/agents/*/generations/")
    return 0 if state == "COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(main())
