"""Bad batches with real processes and real MindSpore: batches skipped inside the step and recorded in
the ledger, a step that keeps crashing workers skipped after `crash_repeats`, and the ledger honoured
after the world size changed. Sample ranges are aligned to the global batch (64) so that a step's
range is exactly the injected one."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np

from tests.harness import Processes, status, trainerctl
from tests.integration.test_recovery import events, final_weights, recovery_job, start_trainerd, wait_for_job
from tests.waiting import wait_until

GLOBAL_BATCH = 64


def mlp_with(tmp_path: Path, steps: int, *flags: str) -> list[str]:
    return ["{python}", "-m", "trainer.examples.mlp", "--steps", str(steps), "--output", str(tmp_path / "out"),
            *flags]


def ledger(address: str) -> list[dict]:
    result = trainerctl("skips", "-o", "json", coordinator=address)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def step_range(step: int) -> tuple[int, int]:
    return (step - 1) * GLOBAL_BATCH, step * GLOBAL_BATCH


def test_nan_and_spike_batches_are_skipped_in_the_step_and_land_in_the_ledger(
        tmp_path: Path, procs: Processes) -> None:
    nan, spike = step_range(101), step_range(201)
    entrypoint = mlp_with(tmp_path, 300, "--bad-samples", "%d:%d" % nan, "--spike-samples", "%d:%d" % spike)
    job = recovery_job(tmp_path, steps=300, nodes=(2, 2), global_batch=GLOBAL_BATCH, micro_batch=32,
                       entrypoint=entrypoint)
    address = start_trainerd(tmp_path, procs, job)
    for i in range(2):
        procs.agent(f"n{i}", address)
    job = wait_for_job(address, "the end", lambda j: j["state"] in ("COMPLETED", "FAILED"), 240, procs)
    assert job["state"] == "COMPLETED" and job["generation"] == 1, job
    entries = ledger(address)
    assert [(e["start"], e["end"]) for e in entries] == [nan, spike]
    assert entries[0]["reason"].startswith("nonfinite") and entries[1]["reason"].startswith("grad_norm_spike")
    assert [e["step"] for e in entries] == [101, 201] and {e["generation"] for e in entries} == {1}
    assert job["skipped_batches"] == 2
    weights = final_weights(tmp_path / "out", 2)
    assert all(np.isfinite(w).all() for w in weights.values())
    manifest = json.loads((tmp_path / "checkpoints" / "step_00000300" / "manifest.json").read_text())
    assert json.dumps([list(nan), list(spike)]) in json.dumps(manifest)


def test_a_step_that_crashes_workers_is_skipped_after_crash_repeats(tmp_path: Path, procs: Processes) -> None:
    crash = step_range(151)
    entrypoint = mlp_with(tmp_path, 300, "--crash-samples", "%d:%d" % crash)
    job = recovery_job(tmp_path, steps=300, nodes=(2, 2), global_batch=GLOBAL_BATCH, micro_batch=32,
                       entrypoint=entrypoint, restart={"max": 5, "backoff_s": 0.2},
                       data_skip={"crash_repeats": 2})
    address = start_trainerd(tmp_path, procs, job)
    for i in range(2):
        procs.agent(f"n{i}", address)
    job = wait_for_job(address, "the end", lambda j: j["state"] in ("COMPLETED", "FAILED"), 300, procs)
    assert job["state"] == "COMPLETED", job
    assert job["generation"] == 3 and job["crash_restarts"] == 2  # two crashes at step 151, then past it
    assert [(e["start"], e["end"]) for e in ledger(address)] == [crash]
    assert "step 151 crashed a worker 2 times" in ledger(address)[0]["reason"]
    started = [e for e in events(address) if e["kind"] == "generation_started"]
    # Both relaunches resume from the newest state before the crashing step: the in-memory snapshot the
    # two agents hold (every 10 steps) or, failing that, the checkpoint of step 100.
    resumed = [e["fields"]["resume_step"] for e in started]
    assert resumed[0] == 0 and resumed[1] == resumed[2] and 100 <= resumed[1] < 151, resumed


def test_the_ledger_is_honoured_after_the_world_size_changes(tmp_path: Path, procs: Processes) -> None:
    crash = step_range(401)  # reading it would kill the worker: the ledger must leave it out
    entrypoint = mlp_with(tmp_path, 600, "--crash-samples", "%d:%d" % crash)
    job = recovery_job(tmp_path, steps=600, nodes=(1, 2), global_batch=GLOBAL_BATCH, micro_batch=32,
                       entrypoint=entrypoint, restart={"max": 0}, start_wait_s=120)  # both agents in generation 1
    address = start_trainerd(tmp_path, procs, job)
    wait_until(lambda: (s := status(address)) and s["coordinator"]["is_leader"], 30, "trainerd leads")
    added = trainerctl("skips", "add", "%d:%d" % crash, "--reason", "known corrupt", coordinator=address)
    assert added.returncode == 0, added.stderr
    for i in range(2):
        procs.agent(f"n{i}", address)
    wait_for_job(address, "2 ranks past the first checkpoint",
                 lambda j: j["world_size"] == 2 and (j["last_checkpoint_step"] or 0) >= 100, 240, procs)
    procs.by_name("n1").signal(signal.SIGKILL)
    job = wait_for_job(address, "the end", lambda j: j["state"] in ("COMPLETED", "FAILED"), 300, procs)
    assert job["state"] == "COMPLETED", job  # restart.max 0: one crash would have failed it
    assert job["generation"] == 2 and job["world_size"] == 1
    assert [(e["start"], e["end"], e["reason"]) for e in ledger(address)] == [(*crash, "operator: known corrupt")]
