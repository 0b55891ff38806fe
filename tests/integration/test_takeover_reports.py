"""Reports the leader never handled are not lost with it: a real etcd, two trainerd (leader and
standby), one real agent and a trainer stand-in without MindSpore (scripted_trainer.py). The leader
is frozen, the trainer reports steps 6-10 and commits step 10 into its stream, and the leader is
killed before it reads them: the standby that takes over shows step 10 and records checkpoint 10
once, from what the agent sends again on its new session, with no new report from the trainer."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests.harness import BIN, Processes, events, status, trainerctl
from tests.integration.cluster_files import cluster_file
from tests.integration.test_recovery import job_of
from tests.ports import free_port, scheduler_port
from tests.waiting import wait_until

SCRIPTED_TRAINER = Path(__file__).with_name("scripted_trainer.py")


def test_a_new_leader_has_the_step_and_the_commit_the_killed_leader_never_read(
        tmp_path: Path, procs: Processes, etcd_server) -> None:
    control, checkpoints = tmp_path / "control", tmp_path / "checkpoints"
    control.mkdir()
    job = {"name": "scripted", "entrypoint": ["{python}", str(SCRIPTED_TRAINER), str(control), str(checkpoints)],
           "min_nodes": 1, "max_nodes": 1, "global_batch": 8, "micro_batch": 8, "scheduler_port": scheduler_port(),
           "stop_grace_s": 3, "start_wait_s": 0, "hang_timeout_s": 600, "checkpoint": {"dir": str(checkpoints)}}
    endpoints = [etcd_server.endpoint]
    leader_address, standby_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    leader = procs.trainerd("leader", cluster_file(tmp_path, "a", listen=leader_address, etcd_endpoints=endpoints,
                                                   job=job))
    wait_until(lambda: (status(leader_address) or {}).get("coordinator", {}).get("is_leader"), 30,
               "the first trainerd leads", on_timeout=procs.logs)
    procs.trainerd("standby", cluster_file(tmp_path, "b", listen=standby_address, etcd_endpoints=endpoints, job=job))
    procs.start("node-a", [str(BIN / "trainerd-agent"), "--coordinator", f"{leader_address},{standby_address}",
                           "--node-name", "node-a", "--cpu-devices", "1", "--work-dir", str(tmp_path / "agents"),
                           "--memory-dir", str(procs.memory_root / "node-a"), "--no-warm-workers",
                           "--no-compile-cache", "--log-level", "DEBUG"])

    def at(address: str, step: int):
        return lambda: ((job := job_of(address)) is not None and job["step"] == step
                        and job["last_checkpoint_step"] == step and job)

    first = wait_until(at(leader_address, 5), 60, "the leader at step 5 with checkpoint 5", interval=0.2,
                       on_timeout=procs.logs)
    assert first["generation"] == 1

    leader.signal(signal.SIGSTOP)  # its sockets still take what the agent writes; nothing reads it
    (control / "go").touch()
    wait_until(lambda: (control / "sent").exists(), 10, "the trainer's steps 6-10 and commit 10", interval=0.05,
               on_timeout=procs.logs)
    time.sleep(0.3)  # the agent forwards the commit at once, into the frozen leader's stream
    leader.signal(signal.SIGKILL)

    taken_over = wait_until(at(standby_address, 10), 30, "the standby at step 10 with checkpoint 10", interval=0.2,
                            on_timeout=procs.logs)
    assert taken_over["generation"] == 1 and taken_over["state"] == "RUNNING"
    assert status(standby_address)["coordinator"]["is_leader"] is True
    saved = [e for e in events(standby_address) if e["kind"] == "checkpoint_saved"]
    assert [e["message"] for e in saved] == ["job scripted: checkpoint at step 5 (40 samples) committed",
                                             "job scripted: checkpoint at step 10 (80 samples) committed"], saved
    assert trainerctl("status", coordinator=standby_address).returncode == 0
