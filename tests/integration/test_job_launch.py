"""A real MindSpore data-parallel job launched and supervised by trainerd and its agents."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import psutil

from tests.harness import Processes, events, processes_mentioning, status
from tests.integration.cluster_files import cluster_file
from tests.integration.conftest import REFERENCE_STEPS, FaultFreeRun
from tests.integration.test_recovery import final_weights
from tests.ports import free_port, scheduler_port
from tests.waiting import wait_until

STEPS = 40


def mlp_job(tmp_path: Path, *, steps: int = STEPS, entrypoint: list[str] | None = None,
            min_step_ms: float = 0) -> dict:
    """`min_step_ms`: the example's floor on a step's time (trainer/examples/step_floor.py)."""
    return {
        "name": "mlp",
        "entrypoint": entrypoint or ["{python}", "-m", "trainer.examples.mlp", "--steps", str(steps),
                                     "--min-step-ms", str(min_step_ms), "--output", str(tmp_path / "out")],
        "min_nodes": 2, "max_nodes": 2, "global_batch": 64, "micro_batch": 32,
        "scheduler_port": scheduler_port(), "stop_grace_s": 3,
    }


def job_state(address: str) -> dict | None:
    data = status(address)
    return None if data is None else data["job"]


def wait_for_state(address: str, states: set[str], timeout: float, procs: Processes) -> dict:
    return wait_until(lambda: (job := job_state(address)) and job["state"] in states and job, timeout,
                      f"job state in {sorted(states)}", interval=0.5, on_timeout=procs.logs)


def start_cluster(tmp_path: Path, procs: Processes, job: dict) -> str:
    address = f"127.0.0.1:{free_port()}"
    procs.trainerd("trainerd", cluster_file(tmp_path, "c", listen=address, local_agents=2, job=job))
    return address


def training_processes(tmp_path: Path) -> list[psutil.Process]:
    return [p for p in processes_mentioning(tmp_path) if "trainer.examples.mlp" in " ".join(p.cmdline())]


def test_job_runs_to_completion_with_identical_weights(fault_free_mlp: FaultFreeRun) -> None:
    """The session's fault-free run (conftest.py), which test_chaos also compares its faulty runs with."""
    job, root = fault_free_mlp.job, fault_free_mlp.root
    assert job["state"] == "COMPLETED", job
    assert job["world_size"] == 2
    assert job["generation"] == 1
    assert job["step"] == REFERENCE_STEPS
    assert [r["rank"] for r in job["ranks"]] == [0, 1]
    assert {r["node"] for r in job["ranks"]} == {"itest-local-0", "itest-local-1"}

    rank0 = np.load(root / "out" / "final_rank0.npz")
    rank1 = np.load(root / "out" / "final_rank1.npz")
    assert sorted(rank0.files) == sorted(rank1.files) and rank0.files
    for name in rank0.files:
        assert np.array_equal(rank0[name], rank1[name]), f"{name} differs between ranks"
    assert fault_free_mlp.training_processes_left == []


DOWN_S = 3.0  # how long trainerd stays stopped before it is started again


def test_trainerd_started_again_goes_on_from_the_newest_checkpoint_to_the_same_weights(
        tmp_path: Path, procs: Processes, fault_free_mlp: FaultFreeRun) -> None:
    """Stopping trainerd stops its local agents and their processes, after the running generation saved a
    checkpoint it asked for. Started again, it leads again (an event says so) and ends the generation whose
    processes are gone, and the next one resumes from that checkpoint: relaunched in place, the generation
    went back to its own start (here: from scratch); without the save, to the last periodic checkpoint."""
    address = f"127.0.0.1:{free_port()}"
    job = {**mlp_job(tmp_path, steps=REFERENCE_STEPS), "checkpoint": {"every_steps": 50, "keep": 2}}
    config = cluster_file(tmp_path, "c", listen=address, local_agents=2, job=job)
    first = procs.trainerd("trainerd", config)
    saved = wait_until(lambda: (job := job_state(address)) and (job["last_checkpoint_step"] or 0) >= 150
                       and job["last_checkpoint_step"], 120, "a checkpoint at step 150", interval=0.2,
                       on_timeout=procs.logs)
    first.signal(signal.SIGTERM)
    first.wait(timeout=30)
    assert training_processes(tmp_path) == []
    time.sleep(DOWN_S)

    procs.trainerd("trainerd", config)
    ended = wait_for_state(address, {"COMPLETED", "FAILED"}, 180, procs)
    assert ended["state"] == "COMPLETED", ended
    # Nothing trained while trainerd was down: those seconds are detection (the only fault), not productive.
    assert ended["goodput"]["phases"]["detection_s"] >= DOWN_S, ended["goodput"]
    assert ended["generation"] == 2 and ended["crash_restarts"] == 0, ended
    # Its local agents come back with no processes (processes_gone), or, on a busy host, later than their
    # reconnect grace (node_lost): the generation is over either way, and relaunched from the checkpoint.
    assert ended["last_failure"]["cause"] in ("processes_gone", "node_lost"), ended["last_failure"]
    seen = events(address)
    assert [e["kind"] for e in seen].count("coordinator_leads") == 2
    [asked] = [e for e in seen if e["kind"] == "checkpoint_requested"]
    assert "trainerd is stopping" in asked["message"] and asked["fields"]["step"] > saved, asked
    [second] = [e for e in seen if e["kind"] == "generation_started" and e["fields"]["generation"] == 2]
    assert second["fields"]["resume_step"] >= asked["fields"]["step"], second
    weights, reference = final_weights(tmp_path / "out", 2), final_weights(fault_free_mlp.root / "out", 2)
    for name, expected in reference.items():
        assert np.array_equal(weights[name], expected), f"{name} differs from the run without the restart"
