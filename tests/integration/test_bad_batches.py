"""Bad batches with real processes and real MindSpore: batches skipped inside the step and recorded in
the ledger, a step that keeps crashing workers skipped after `crash_repeats`, and the ledger honoured
after the world size changed. Sample ranges are aligned to the global batch (64) so that a step's
range is exactly the injected one."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.harness import Processes, events, status, trainerctl
from tests.integration.test_recovery import final_weights, recovery_job, start_trainerd, wait_for_job
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


def test_a_nan_batch_is_skipped_and_lands_in_the_ledger_and_a_spike_with_an_ordinary_loss_is_applied(
        tmp_path: Path, procs: Processes) -> None:
    """The NaN batch reproduces on its replay: bad data. The x20 batch at step 201 makes a norm spike that
    reproduces too, but its loss (0.74, against a running mean of 0.55 and a spread of 0.58 in the log) is no
    more than the loss's own swings: the rule applies it, clipped, as it does a healthy model's excursions."""
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
    assert [(e["start"], e["end"]) for e in entries] == [nan]
    assert entries[0]["reason"].startswith("nonfinite")
    assert [e["step"] for e in entries] == [101] and {e["generation"] for e in entries} == {1}
    assert job["skipped_batches"] == 1
    weights = final_weights(tmp_path / "out", 2)
    assert all(np.isfinite(w).all() for w in weights.values())
    manifest = json.loads((tmp_path / "checkpoints" / "step_00000300" / "manifest.json").read_text())
    assert json.dumps([list(nan)]) in json.dumps(manifest)


def test_a_step_that_crashes_workers_is_skipped_after_crash_repeats(tmp_path: Path, procs: Processes) -> None:
    crash = step_range(151)
    entrypoint = mlp_with(tmp_path, 300, "--crash-samples", "%d:%d" % crash)
    job = recovery_job(tmp_path, steps=300, nodes=(2, 2), global_batch=GLOBAL_BATCH, micro_batch=32,
                       entrypoint=entrypoint, restart={"max": 5, "backoff_s": 0.2},
                       data_skip={"crash_repeats": 2}, memory_every=10)
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


def test_a_device_that_corrupts_one_step_is_blamed_not_the_data_and_the_weights_stay_exact(
        tmp_path: Path, procs: Processes) -> None:
    """--corrupt-grad 1:200: rank 1's gradients of step 200 come out 1e4 times too large, once, as a flaky
    device's would. The replay computes the step right: a device_suspected event names rank 1's node, no
    samples are skipped, and the final weights are those of a run without the fault, bit for bit."""
    clean = tmp_path / "clean"
    # By hand, one process with 2 micro batches of 32 adds the same two gradients the 2 ranks all-reduce.
    subprocess.run([sys.executable, "-m", "trainer.examples.mlp", "--steps", "300", "--global-batch", "64",
                    "--micro-batch", "32", "--output", str(clean)], check=True, timeout=240, capture_output=True)
    entrypoint = mlp_with(tmp_path, 300, "--corrupt-grad", "1:200")
    job = recovery_job(tmp_path, steps=300, nodes=(2, 2), global_batch=GLOBAL_BATCH, micro_batch=32,
                       entrypoint=entrypoint)
    address = start_trainerd(tmp_path, procs, job)
    for i in range(2):
        procs.agent(f"n{i}", address)
    job = wait_for_job(address, "the end", lambda j: j["state"] in ("COMPLETED", "FAILED"), 240, procs)
    assert job["state"] == "COMPLETED" and job["generation"] == 1, job
    assert ledger(address) == [] and job["skipped_batches"] == 0
    suspected = [e for e in events(address) if e["kind"] == "device_suspected"]
    assert len(suspected) == 1, suspected
    fields = suspected[0]["fields"]
    assert fields["rank"] == 1 and fields["node"] in ("n0", "n1")
    assert f"rank 1 on node {fields['node']} (device 0)" in suspected[0]["message"]
    assert "step 200" in suspected[0]["message"] and "no samples were skipped" in suspected[0]["message"]
    faulted, reference = final_weights(tmp_path / "out", 2), np.load(clean / "final_rank0.npz")
    for name in reference.files:
        assert np.array_equal(faulted[name], reference[name]), name
