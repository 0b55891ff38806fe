"""trainerd's scheduler (trainer/runtime/scheduler.py), as real processes on real MindSpore: it serves the
cluster; when no rank joins within MS_TOPO_TIMEOUT, one rank that trains without init() needs it no more (it
waits for the generation's stop), while a larger world cannot form (it exits 1, saying why)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from proto.exit_codes import EXIT_USAGE
from tests.ports import free_port

pytestmark = pytest.mark.mindspore  # MindSpore processes: left out of `make test-fast`

REPO = Path(__file__).resolve().parents[2]


def scheduler(world_size: int, role: str = "MS_SCHED", port: int = 0) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "RANK_", "TRAINERD_"))}
    env.update({"MS_ROLE": role, "MS_WORKER_NUM": str(world_size), "RANK_SIZE": str(world_size), "RANK_ID": "0",
                "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": str(port or free_port()), "MS_TOPO_TIMEOUT": "3",
                "GLOG_v": "3", "TRAINERD_JOB": "j", "TRAINERD_GENERATION": "4", "MS_NODE_ID": "0", "DEVICE_ID": "0",
                "TRAINERD_LOCAL_RANK": "-1" if role == "MS_SCHED" else "0"})
    return subprocess.Popen([sys.executable, "-m", "trainer.runtime.scheduler"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_world_of_one_rank_that_never_joins_leaves_the_scheduler_waiting_for_the_stop() -> None:
    port = free_port()
    one, two = scheduler(1, port=port), scheduler(2)  # side by side: each waits out MindSpore's topology timeout
    try:
        assert one.stdout is not None
        assert one.stdout.readline() == (f"trainerd scheduler: job j generation 4: serving the cluster of 1 rank(s) at "
                                         f"127.0.0.1:{port}\n")
        waiting = one.stdout.readline()
        assert waiting.startswith("trainerd scheduler: no rank joined the cluster in ") and waiting.endswith(
            "needs no scheduler; waiting for the generation to end\n"), waiting
        assert one.poll() is None
        one.send_signal(signal.SIGTERM)
        assert one.wait(timeout=10) == -signal.SIGTERM

        _, err = two.communicate(timeout=60)
        assert two.returncode == 1
        [line] = [line for line in err.splitlines() if line.startswith("trainerd scheduler:")]
        assert line.startswith("trainerd scheduler: MindSpore's scheduler failed after ") and "cluster" in line
    finally:
        for process in (one, two):
            process.kill()
            process.wait(timeout=10)


def test_it_refuses_to_run_as_anything_but_a_scheduler() -> None:
    worker = scheduler(2, role="MS_WORKER")
    _, err = worker.communicate(timeout=60)
    assert worker.returncode == EXIT_USAGE
    assert err == "trainerd scheduler: MS_ROLE is not MS_SCHED: only the agent runs this, as a generation's scheduler\n"
