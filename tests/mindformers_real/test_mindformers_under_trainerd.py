"""A MindFormers job under trainerd's real coordinator and agent, with a fault: the tiny LLaMA on one device
(use_parallel False, as a single-device YAML runs), its worker SIGKILLed after a checkpoint. Real trainerd,
etcd, agent and MindFormers 2.0.0 on MindSpore's CPU backend; run by `make test-mindformers`. About a minute."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import psutil
from safetensors.numpy import load_file

from tests.harness import Processes, processes_mentioning, status
from tests.integration.cluster_files import cluster_file
from tests.mindformers_real.test_mindformers_real import SUPPORT, ProgressSocket, run_generation, tiny_llama_yaml
from tests.ports import free_port
from tests.waiting import wait_until

STEPS, EVERY, KEEP = 1000, 200, 2  # global batch 2: 2,000 samples; about 50 steps a second here


def iteration_tensors(root: Path, iteration: int) -> dict[str, np.ndarray]:
    directory = root / f"iteration_{iteration:08d}"
    tensors: dict[str, np.ndarray] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update({f"{path.name.split('-')[1]}/{k}": v for k, v in load_file(path).items()})
    assert tensors, f"no safetensors files in {directory}"
    return tensors


def worker_processes(root: Path) -> list[psutil.Process]:
    """The rank's process: the launcher exec'd into the runner. (The scheduler stays the launcher, waiting.)"""
    return [p for p in processes_mentioning(root) if len(p.cmdline()) > 1 and p.cmdline()[1].endswith("run_mindformer_cpu.py")]


def test_a_killed_worker_resumes_through_mindformers_own_settings_to_the_weights_of_a_run_without_the_fault(
        tmp_path: Path) -> None:
    user_yaml = tiny_llama_yaml(tmp_path, samples=2 * STEPS)
    runner = [str(SUPPORT / "run_mindformer_cpu.py"), str(SUPPORT / "train_runner.py"), "--run_mode", "train",
              "--use_parallel", "False"]

    # The run without the fault: the same generation YAML, as one generation of the launcher alone.
    reference = tmp_path / "reference"
    progress = ProgressSocket()
    try:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINERD_", "MS_", "RANK_"))}
        run_generation(user_yaml, {**base, "TRAINERD_JOB": "llama", "TRAINERD_GENERATION": "1",
                                   "TRAINERD_PROGRESS_SOCKET": progress.path, "TRAINERD_CHECKPOINT_DIR": str(reference),
                                   "TRAINERD_CHECKPOINT_EVERY": str(EVERY), "TRAINERD_CHECKPOINT_KEEP": str(KEEP),
                                   "TMPDIR": str(tmp_path)}, tmp_path)
    finally:
        progress.close()

    ckpt = tmp_path / "ckpt"
    address = f"127.0.0.1:{free_port()}"
    job = {"name": "llama", "checkpoint": {"dir": str(ckpt), "every_steps": EVERY, "keep": KEEP},
           "entrypoint": ["{python}", "-m", "trainer.integrations.mindformers.launch", "--config", str(user_yaml),
                          "--", "{python}", *runner],
           "scheduler_port": free_port(), "stop_grace_s": 3, "restart": {"backoff_s": 0}}
    procs = Processes(tmp_path)
    try:
        procs.trainerd("trainerd", cluster_file(tmp_path, "c", listen=address, local_agents=1, job=job))

        def job_now() -> dict:
            data = status(address)
            return data["job"] if data else {}

        wait_until(lambda: (job_now().get("last_checkpoint_step") or 0) >= EVERY and job_now().get("step", 0) > EVERY + 10,
                   180, f"a checkpoint at step {EVERY} and steps past it", interval=0.2, on_timeout=procs.logs)
        [worker] = worker_processes(tmp_path / "c-agents")
        killed_at = job_now()["step"]
        worker.send_signal(signal.SIGKILL)
        done = wait_until(lambda: job_now().get("state") in ("COMPLETED", "FAILED") and job_now(), 240,
                          "the job to end", interval=0.5, on_timeout=procs.logs)
        assert done["state"] == "COMPLETED" and done["step"] == STEPS and done["generation"] == 2, done
        recovery = done["last_recovery"]
        assert recovery["resumed_from"] == "disk" and recovery["resumed_from_step"] % EVERY == 0, recovery
        assert recovery["resumed_from_step"] < killed_at <= recovery["resumed_from_step"] + recovery["lost_steps"] + 10

        # trainerd's own scheduler: none of MindFormers runs there (it would train a second copy into ckpt/)
        scheduler_logs = [log.read_text() for log in (tmp_path / "c-agents").glob("*/generations/*/scheduler.log")]
        assert len(scheduler_logs) == 2 and all("trainerd scheduler: job llama generation" in log
                                                and "mindformers" not in log.lower() for log in scheduler_logs)
    finally:
        procs.cleanup()

    # What retention leaves: the newest KEEP, not KEEP a generation (MindFormers prunes only its own process's).
    assert sorted(p.name for p in ckpt.glob("iteration_*")) == [
        f"iteration_{n:08d}" for n in range(STEPS - (KEEP - 1) * EVERY, STEPS + 1, EVERY)]
    final, expected = iteration_tensors(ckpt, STEPS), iteration_tensors(reference, STEPS)
    assert sorted(final) == sorted(expected)
    for name, value in expected.items():
        assert np.array_equal(final[name], value), f"{name} differs from the run without the fault"
