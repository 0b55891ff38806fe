"""A script written for one device (it never calls mindspore.communication.init()) as a trainerd job on one
device: it runs once. msrun-style, the scheduler ran the job's command too, and such a script then trained
a second copy in the scheduler beside its rank, writing the same checkpoint files in the same directory.
Real trainerd, agent and MindSpore."""

from __future__ import annotations

from pathlib import Path

from tests.harness import Processes
from tests.integration.test_recovery import start_trainerd, wait_for_job
from tests.ports import scheduler_port

SCRIPT = Path(__file__).with_name("jobs") / "single_device.py"


def test_a_script_for_one_device_runs_once_and_its_scheduler_waits_for_it(tmp_path: Path, procs: Processes) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    job = {"name": "one-device", "entrypoint": ["{python}", str(SCRIPT), "--step-sleep", "0.3"],
           "workdir": str(workdir), "scheduler_port": scheduler_port(), "stop_grace_s": 3, "start_wait_s": 0,
           # MindSpore's scheduler gives up waiting for a rank after this (trainerd's default: 600 s, as msrun)
           "env": {"MS_TOPO_TIMEOUT": "4"}}
    address = start_trainerd(tmp_path, procs, job)
    procs.agent("n0", address)
    done = wait_for_job(address, "the job to end", lambda j: j["state"] in ("COMPLETED", "FAILED"), 180, procs)
    assert done["state"] == "COMPLETED" and done["generation"] == 1 and done["restarts"] == 0, done
    assert done["step"] == 40, done  # 2 epochs of 20 steps (320 samples, batch 16), read from LossMonitor's lines

    runs = (workdir / "runs.txt").read_text().split()
    assert runs[1::2] == ["MS_WORKER"], runs  # the script ran once, as the rank
    assert sorted(p.name for p in (workdir / "ckpt").glob("*.ckpt")) == [
        "net-1_20.ckpt", "net-2_20.ckpt"]
    [scheduler_log] = (tmp_path / "agents" / "n0").glob("generations/*/scheduler.log")
    assert "the job's one rank trains without mindspore.communication.init() and needs no scheduler" in \
        scheduler_log.read_text(), scheduler_log.read_text()[-2000:]
