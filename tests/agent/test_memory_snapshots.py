"""The agent's shared memory for in-memory snapshots (agent/memory_snapshots.py) and what the supervisor
does with it: the workers' variables at a Launch, the snapshots a new generation must not see, and
the newest complete snapshot in the heartbeats. Real directories (on tmp_path: the logic does not
depend on tmpfs), a fake launcher."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from agent.memory_snapshots import MANIFEST_NAME, MemoryDirError, MemorySnapshotDir, Snapshot, step_dir_name
from proto import trainerd_pb2 as pb
from tests.agent.supervisor_fakes import Host, launch, run
from trainer.checkpoint import manifest as checkpoint_manifest


def snapshot(job_dir: Path, step: int, *, committed: bool = True) -> Path:
    """What the workers leave: a rank file, and the manifest once rank 0 committed."""
    step_dir = job_dir / step_dir_name(step)
    step_dir.mkdir(parents=True)
    (step_dir / "rank_0.safetensors").write_bytes(b"x" * 16)
    if committed:
        (step_dir / MANIFEST_NAME).write_text(json.dumps({"schema": 1, "step": step, "consumed_samples": 8 * step}))
    return step_dir


def test_the_names_are_the_checkpoints() -> None:
    assert MANIFEST_NAME == checkpoint_manifest.MANIFEST_NAME
    assert step_dir_name(120) == checkpoint_manifest.step_dir_name(120)


def test_the_newest_snapshot_is_the_newest_with_its_manifest(tmp_path: Path) -> None:
    memory = MemorySnapshotDir(tmp_path / "shm")
    job_dir = memory.prepare("job", None)
    assert memory.newest("job") is None
    snapshot(job_dir, 10)
    snapshot(job_dir, 20)
    torn = snapshot(job_dir, 30, committed=False)  # a crash in the middle of the copy
    assert memory.newest("job") == Snapshot(20, 160)
    (torn / MANIFEST_NAME).write_text("{not json")  # still being written, or damaged
    assert memory.newest("job") == Snapshot(20, 160)
    (torn / MANIFEST_NAME).unlink()
    os.mkfifo(torn / MANIFEST_NAME)  # a worker's trap: the agent must not wait on it
    assert memory.newest("job") == Snapshot(20, 160)
    (torn / MANIFEST_NAME).unlink()
    (torn / MANIFEST_NAME).write_text(json.dumps({"step": 30, "consumed_samples": 240}))
    assert memory.newest("job") == Snapshot(30, 240)
    assert memory.newest("other") is None


def test_a_launch_drops_other_jobs_and_the_snapshots_after_its_resume_step(tmp_path: Path) -> None:
    memory = MemorySnapshotDir(tmp_path / "shm")
    snapshot(memory.prepare("old-job", None), 5)
    job_dir = memory.prepare("job", None)
    for step in (10, 20, 30):
        snapshot(job_dir, step)
    snapshot(memory.job_dir("old-job"), 5)  # left by an agent that died before this one
    assert memory.prepare("job", 20) == job_dir
    assert sorted(p.name for p in memory.root.iterdir()) == ["job"]
    assert sorted(p.name for p in job_dir.iterdir()) == [step_dir_name(10), step_dir_name(20)]
    assert memory.newest("job") == Snapshot(20, 160)
    memory.prepare("job", None)  # from scratch: nothing of an earlier timeline is left
    assert list(job_dir.iterdir()) == []
    memory.clear()
    assert not memory.root.exists()


def test_the_snapshot_reported_outlives_the_workers_retention(tmp_path: Path) -> None:
    """The workers keep only their newest snapshot, and the coordinator may name the one the last heartbeat
    reported: the agent pins what it reports (hard links), so a relaunch named it still finds it whole."""
    memory = MemorySnapshotDir(tmp_path / "shm")
    job_dir = memory.prepare("job", None)
    snapshot(job_dir, 10)
    assert memory.newest("job") == Snapshot(10, 80)  # reported in a heartbeat
    snapshot(job_dir, 20)
    shutil.rmtree(job_dir / step_dir_name(10))  # the workers' retention, before the next heartbeat
    snapshot(job_dir, 30, committed=False)  # and a crash in the middle of the next copy
    assert memory.prepare("job", 10) == job_dir  # the coordinator relaunches from what it was told: 10
    resume = memory.resume_path("job", 10)
    assert resume != job_dir / step_dir_name(10) and resume.is_relative_to(job_dir)
    assert json.loads((resume / MANIFEST_NAME).read_text())["step"] == 10
    assert (resume / "rank_0.safetensors").read_bytes() == b"x" * 16
    assert memory.newest("job") == Snapshot(10, 80)
    snapshot(job_dir, 40)  # the relaunch snapshots again: the pin moves on, the one before kept
    assert memory.newest("job") == Snapshot(40, 320)
    assert memory.resume_path("job", 40) != job_dir / step_dir_name(40)
    assert memory.resume_path("job", 10) == resume  # a choice made from the report before still holds
    snapshot(job_dir, 50)
    assert memory.newest("job") == Snapshot(50, 400)
    assert memory.resume_path("job", 10) == job_dir / step_dir_name(10)  # two reports ago: gone
    assert memory.resume_path("job", 40) != job_dir / step_dir_name(40)


def test_a_root_that_is_not_the_agents_own_directory_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "shm")
    with pytest.raises(MemoryDirError, match="is not a directory of this agent's user"):
        MemorySnapshotDir(tmp_path / "shm").prepare("job", None)


def memory_launch(generation: int, **env: str) -> pb.Launch:
    message = launch(generation)
    for process in message.processes:
        process.env.update(env)
    return message


def test_the_supervisor_gives_its_workers_the_memory_and_reports_the_newest_snapshot(tmp_path: Path) -> None:
    async def scenario() -> None:
        memory = MemorySnapshotDir(tmp_path / "shm")
        host = Host(tmp_path / "work", memory=memory)
        (tmp_path / "work").mkdir()
        await host.supervisor.launch(memory_launch(1, TRAINERD_MEMORY_EVERY="5", TRAINERD_RESUME_STEP="",
                                                   TRAINERD_RESUME_FROM=""))
        env = host.launcher.started["rank1"].env
        job_dir = tmp_path / "shm" / "job"
        assert env["TRAINERD_MEMORY_DIR"] == str(job_dir) and env["TRAINERD_RESUME_FROM"] == ""
        assert not host.supervisor.heartbeat().HasField("memory_snapshot")
        snapshot(job_dir, 15)
        assert host.supervisor.heartbeat().memory_snapshot.step == 15
        snapshot(job_dir, 20)  # after the heartbeat: the Stop's confirmation tells of it at once
        await host.supervisor.stop(pb.Stop(generation=1, grace_s=1.0))
        assert host.sent("stopped")[-1].memory_snapshot == pb.MemorySnapshot(step=20, consumed_samples=160)
        assert host.supervisor.heartbeat().memory_snapshot == pb.MemorySnapshot(step=20, consumed_samples=160)

        # The coordinator chose the snapshot of step 15 (say, 20 failed to load): the agent names its copy.
        await host.supervisor.launch(memory_launch(2, TRAINERD_MEMORY_EVERY="5", TRAINERD_RESUME_STEP="15",
                                                   TRAINERD_RESUME_MEMORY_STEP="15", TRAINERD_RESUME_FROM=""))
        env = host.launcher.started["rank1"].env
        assert env["TRAINERD_RESUME_FROM"] == str(job_dir / ".reported" / step_dir_name(15))  # reported before 20
        assert host.supervisor.heartbeat().memory_snapshot.step == 15  # 20 belongs to an abandoned future

        # A generation without snapshots (several hosts) still drops what is newer than its resume step.
        await host.supervisor.launch(memory_launch(3, TRAINERD_MEMORY_EVERY="0", TRAINERD_RESUME_STEP="12"))
        env = host.launcher.started["rank1"].env
        assert "TRAINERD_MEMORY_DIR" not in env and env["TRAINERD_MEMORY_EVERY"] == "0"
        assert not host.supervisor.heartbeat().HasField("memory_snapshot")
        await host.supervisor.stop(pb.Stop(generation=3, grace_s=1.0))
        assert job_dir.is_dir()  # a failed job may be resumed from memory
        await host.supervisor.stop(pb.Stop(generation=3, grace_s=1.0, job_completed=True))
        assert not job_dir.exists()

    run(scenario())
