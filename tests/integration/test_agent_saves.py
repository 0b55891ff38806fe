"""Disk checkpoints saved by the agent (`checkpoint.saved_by: agent`, agent/snapshots/checkpoint_persister.py) with real
processes: trainerd, an agent, real MindSpore workers on the CPU.

The same job runs twice: saved by its workers (the default) and saved by its agent with a worker killed
between two checkpoints. The agent's checkpoints hold the same bytes as the workers' (a checkpoint is the
same either way), the killed run resumes from the newest one the agent saved, and its final weights equal
the unfaulted run's bit for bit.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import numpy as np

from tests.harness import Processes, events, processes_mentioning
from tests.integration.test_recovery import final_weights, recovery_job, start_trainerd, wait_for_job
from tests.waiting import wait_until
from trainer.checkpoint import load_checkpoint, verify_checkpoint
from trainer.checkpoint.manifest import read_manifest


def test_checkpoints_saved_by_the_agent_equal_the_workers_and_a_killed_worker_resumes_from_them(
        tmp_path: Path, procs: Processes) -> None:
    steps, every = 600, 100
    runs = {}
    for saved_by in ("worker", "agent"):
        run_dir = tmp_path / saved_by
        run_dir.mkdir()
        # No in-memory snapshots: the relaunch must resume from the disk checkpoint the agent saved.
        job = recovery_job(run_dir, steps=steps, nodes=(1, 1), global_batch=64, micro_batch=16, devices_per_node=2,
                           every=every, memory_every=0, restart={"backoff_s": 0})
        job["checkpoint"] |= {"keep": 10, "saved_by": saved_by}
        address = start_trainerd(run_dir, procs, job, name=f"trainerd-{saved_by}")
        procs.agent(f"{saved_by}-0", address, cpu_devices=2)
        if saved_by == "agent":
            # Any step past the second checkpoint: the MLP runs 100 steps a second, and a narrower window
            # between checkpoints could slip between two polls every time until the job was done.
            before = wait_for_job(address, "two checkpoints and some steps after", lambda j: (
                j["last_checkpoint_step"] or 0) >= 2 * every and (j["step"] or 0) > j["last_checkpoint_step"],
                240, procs)
            rank1 = next(p for p in processes_mentioning(run_dir / "out")
                         if p.environ().get("RANK_ID") == "1" and p.environ().get("MS_ROLE") == "MS_WORKER")
            assert rank1.environ().get("TRAINERD_CHECKPOINT_OUTBOX", "").endswith("/.outbox")
            rank1.send_signal(signal.SIGKILL)
        job_status = wait_for_job(address, "the end", lambda j: j["state"] in ("COMPLETED", "FAILED"), 300, procs)
        assert job_status["state"] == "COMPLETED", job_status
        runs[saved_by] = (address, job_status, final_weights(run_dir / "out", 2), run_dir / "checkpoints")

    address, job_status, weights, checkpoints = runs["agent"]
    recovery = job_status["last_recovery"]
    assert recovery["resumed_from"] == "disk" and recovery["resumed_from_step"] >= before["last_checkpoint_step"]
    assert recovery["resumed_from_step"] % every == 0 and job_status["last_checkpoint_step"] == steps
    saved = [e for e in events(address) if e["kind"] == "checkpoint_saved"]
    assert len(saved) >= steps // every, saved  # the steps redone after the kill are saved again
    _, _, reference_weights, reference_checkpoints = runs["worker"]
    for name, expected in reference_weights.items():
        assert np.array_equal(weights[name], expected), f"{name} differs from the run saved by its workers"
    # Every checkpoint, the ones before the kill and the ones of the relaunch, holds the workers' bytes.
    names = sorted(p.name for p in reference_checkpoints.glob("step_*"))
    assert names == sorted(p.name for p in checkpoints.glob("step_*")) and len(names) == steps // every
    for name in names:
        ours, theirs = verify_checkpoint(checkpoints / name), verify_checkpoint(reference_checkpoints / name)
        assert (ours.meta, ours.world_size, ours.tensors) == (theirs.meta, theirs.world_size, theirs.tensors)
        for entry in theirs.files:
            assert (checkpoints / name / entry.name).read_bytes() == (reference_checkpoints / name /
                                                                       entry.name).read_bytes()
    last = checkpoints / names[-1]
    assert read_manifest(last).generation == 2  # saved after the relaunch
    tensors, _ = load_checkpoint(last, 0, 3)  # and it reshards like any other
    assert sorted(tensors) == sorted(load_checkpoint(reference_checkpoints / names[-1], 0, 1)[0])
    # Nothing is left in memory: the job's directory (its outbox with it) goes once the job completed.
    wait_until(lambda: not (procs.memory_root / "agent-0" / "mlp").exists(), 10, "the completed job's memory gone")


def test_across_hosts_each_agent_saves_its_ranks_and_rank_0s_agent_commits(tmp_path: Path, procs: Processes) -> None:
    """Two agents of one rank each: every checkpoint has one rank's file from each agent, committed by the
    agent of rank 0 once the other's report is there. In-memory snapshots are on (every 30 steps): each
    disk save is taken from a snapshot of its step, whose file the rank wrote once."""
    steps, every = 300, 100
    job = recovery_job(tmp_path, steps=steps, nodes=(2, 2), global_batch=64, micro_batch=16, every=every,
                       memory_every=30)
    job["checkpoint"] |= {"saved_by": "agent"}
    address = start_trainerd(tmp_path, procs, job)
    for node in ("host-0", "host-1"):
        procs.agent(node, address)
    job_status = wait_for_job(address, "the end", lambda j: j["state"] in ("COMPLETED", "FAILED"), 300, procs)
    assert job_status["state"] == "COMPLETED" and job_status["last_checkpoint_step"] == steps, job_status
    final_weights(tmp_path / "out", 2)  # the two ranks agree
    saved = [e for e in events(address) if e["kind"] == "checkpoint_saved"]
    assert len(saved) == steps // every, saved
    checkpoints = tmp_path / "checkpoints"
    for step in range(every, steps + 1, every):
        manifest = verify_checkpoint(checkpoints / f"step_{step:08d}")
        assert manifest.world_size == 2 and sorted(f.name for f in manifest.files) == [
            "rank_0.safetensors", "rank_1.safetensors"]
    logs = {agent: procs.by_name(agent).log() for agent in ("host-0", "host-1")}
    # Each agent saved its own rank's share of every checkpoint; one of them, rank 0's, committed them all.
    for log in logs.values():
        assert len(re.findall(r"rank \d's share of step \d+ saved in", log)) == steps // every, log[-3000:]
    assert sorted(log.count("(saved by the agent)") for log in logs.values()) == [0, steps // every]
    # ... from the in-memory snapshot of its step, which each rank wrote once.
    worker_logs = sorted(tmp_path.glob("agents/*/generations/*/rank*.log"))
    assert len(worker_logs) == 2, worker_logs
    for worker_log in worker_logs:
        assert worker_log.read_text().count("the agent saves the checkpoint from this rank's in-memory "
                                            "snapshot") == steps // every, worker_log
