"""The agent's shared memory for in-memory snapshots (agent/snapshots/memory_snapshots.py) and what the supervisor
does with it: the workers' variables at a Launch, the snapshots a new generation must not see, and
the newest complete snapshot in the heartbeats. Real directories (on tmp_path: the logic does not
depend on tmpfs), a fake launcher."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from agent.commands import Launch, Stop
from agent.snapshots.memory_snapshots import (
    MANIFEST_NAME,
    HostScope,
    MemoryDirError,
    MemorySnapshotDir,
    Snapshot,
    SnapshotAssemblyError,
    step_dir_name,
)
from proto import trainerd_pb2 as pb
from tests.agent.snapshot_files import TENSORS, host_snapshot
from tests.agent.supervisor_fakes import Host, launch, run
from trainer.checkpoint import load_checkpoint, reshard_checkpoint
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


def memory_launch(generation: int, **env: str) -> Launch:
    return launch(generation, env=env)


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
        await host.supervisor.stop(Stop(generation=1, grace_s=1.0))
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
        await host.supervisor.stop(Stop(generation=3, grace_s=1.0))
        assert job_dir.is_dir()  # a failed job may be resumed from memory
        await host.supervisor.stop(Stop(generation=3, grace_s=1.0, job_completed=True))
        assert not job_dir.exists()

    run(scenario())


# A generation spanning hosts (scope host): the workers write rank files and reports, never a manifest.

def copy_snapshot(source: Path, into: Path) -> Path:
    """What the ring copier leaves: the step directory's rank files and reports, copied."""
    into.mkdir(parents=True)
    for child in source.iterdir():
        shutil.copy2(child, into / child.name)
    return into


HOST = HostScope(local_ranks=(0, 1), world_size=4, generation=3)


def test_a_step_complete_on_this_host_is_pinned_and_the_older_workers_directories_go(tmp_path: Path) -> None:
    memory = MemorySnapshotDir(tmp_path / "shm")
    job_dir = memory.prepare("job", None, HOST)
    host_snapshot(job_dir, 10, (0, 1))
    host_snapshot(job_dir, 20, (0,))  # rank 1 is still writing
    host_snapshot(job_dir, 30, (0, 1), generation=2)  # left by another generation
    assert memory.newest("job") == Snapshot(10, 80)
    assert not (job_dir / step_dir_name(10) / MANIFEST_NAME).exists()
    host_snapshot(job_dir, 20, (1,))
    assert memory.newest("job") == Snapshot(20, 160)
    assert not (job_dir / step_dir_name(10)).exists()  # the workers prune nothing: the agent does
    assert (job_dir / step_dir_name(20)).is_dir()
    pins = job_dir / ".reported"
    assert sorted(p.name for p in pins.iterdir()) == [step_dir_name(10), step_dir_name(20)]
    assert sorted(p.name for p in (pins / step_dir_name(20)).iterdir()) == [
        "rank_0.done.json", "rank_0.safetensors", "rank_1.done.json", "rank_1.safetensors"]
    own = memory.own_snapshots("job")
    assert [(s.step, list(s.ranks), s.world_size, s.generation, s.consumed_samples) for s in own] == [
        (20, [0, 1], 4, 3, 160), (10, [0, 1], 4, 3, 80)]
    data = memory.rank_file("job", 20, 1, pb.PEER_FILE_DATA)
    assert data == pins / step_dir_name(20) / "rank_1.safetensors"
    assert memory.rank_file("job", 20, 1, pb.PEER_FILE_REPORT) == pins / step_dir_name(20) / "rank_1.done.json"
    assert memory.rank_file("job", 20, 2, pb.PEER_FILE_DATA) is None  # not this host's
    assert memory.rank_file("job", 30, 0, pb.PEER_FILE_DATA) is None  # not pinned
    assert memory.rank_file("job", 20, 0, pb.PEER_FILE_KIND_UNSPECIFIED) is None
    host_snapshot(job_dir, 40, (0, 1))
    assert memory.newest("job") == Snapshot(40, 320)
    assert sorted(p.name for p in pins.iterdir()) == [step_dir_name(20), step_dir_name(40)]
    assert sorted(p.name for p in job_dir.iterdir() if p.name.startswith("step_")) == [step_dir_name(40)]


def test_held_merges_the_own_pins_and_the_complete_copies(tmp_path: Path) -> None:
    memory = MemorySnapshotDir(tmp_path / "shm")
    job_dir = memory.prepare("job", None, HOST)
    other = tmp_path / "other-host"
    host_snapshot(job_dir, 10, (0, 1))
    assert memory.newest("job") == Snapshot(10, 80)
    host_snapshot(job_dir, 20, (0, 1))
    assert memory.newest("job") == Snapshot(20, 160)
    copies = memory.copies_root("job")
    assert copies == job_dir / ".copies"
    copy_snapshot(host_snapshot(other, 20, (2, 3)), copies / "node-b" / step_dir_name(20))
    copy_snapshot(host_snapshot(other, 30, (2, 3)), copies / "node-b" / (step_dir_name(30) + ".partial"))
    copy_snapshot(host_snapshot(other, 10, (2,), generation=1), copies / "node-b" / step_dir_name(10))
    held = memory.held("job")
    assert [(s.step, list(s.ranks), s.world_size, s.generation, s.consumed_samples) for s in held] == [
        (20, [0, 1, 2, 3], 4, 3, 160)]  # 30 is still being copied; 10's reports disagree
    # A peer may fetch a copied rank too: a relaunch after node-b was lost finds its ranks here.
    assert memory.rank_file("job", 20, 3, pb.PEER_FILE_DATA) == copies / "node-b" / step_dir_name(20) / \
        "rank_3.safetensors"
    assert memory.rank_file("job", 30, 3, pb.PEER_FILE_DATA) is None  # a partial copy is no copy
    assert [s.step for s in memory.own_snapshots("job")] == [20, 10]


def test_a_launch_drops_the_copies_and_assembled_snapshots_after_its_resume_step(tmp_path: Path) -> None:
    memory = MemorySnapshotDir(tmp_path / "shm")
    job_dir = memory.prepare("job", None, HOST)
    node = memory.copies_root("job") / "node-b"
    for name in (step_dir_name(10), step_dir_name(20), step_dir_name(10) + ".partial"):
        (node / name).mkdir(parents=True)
    for step in (10, 20):
        (job_dir / ".resume" / step_dir_name(step)).mkdir(parents=True)
    memory.prepare("job", 10, HOST)
    assert sorted(p.name for p in node.iterdir()) == [step_dir_name(10)]
    assert sorted(p.name for p in (job_dir / ".resume").iterdir()) == [step_dir_name(10)]
    memory.prepare("job", 15, HOST)  # a resume from elsewhere: nothing assembled before serves it
    assert list((job_dir / ".resume").iterdir()) == []
    assert sorted(p.name for p in node.iterdir()) == [step_dir_name(10)]
    memory.prepare("job", None, HOST)
    assert not (job_dir / ".copies").exists() and not (job_dir / ".resume").exists()


def three_hosts(tmp_path: Path, step: int = 50) -> list[MemorySnapshotDir]:
    """Three hosts, each running one rank of a world of 3 and pinning its snapshot of `step`."""
    hosts = []
    for rank in range(3):
        memory = MemorySnapshotDir(tmp_path / f"host{rank}")
        job_dir = memory.prepare("job", None, HostScope((rank,), 3, 3))
        host_snapshot(job_dir, step, (rank,), world_size=3)
        assert memory.newest("job") == Snapshot(step, 8 * step)
        hosts.append(memory)
    return hosts


def fetcher(holder: MemorySnapshotDir, step: int, fetched: list[int]) -> Callable[[int, Path], None]:
    """What the peer client does, read from the holder's files directly."""

    def fetch(rank: int, into: Path) -> None:
        fetched.append(rank)
        for kind, name in ((pb.PEER_FILE_DATA, f"rank_{rank}.safetensors"), (pb.PEER_FILE_REPORT,
                                                                             f"rank_{rank}.done.json")):
            source = holder.rank_file("job", step, rank, kind)
            if source is None:
                raise SnapshotAssemblyError(f"rank {rank} is not held")
            shutil.copyfile(source, into / name)

    return fetch


def test_an_assembled_snapshot_loads_and_reshards_bit_exact(tmp_path: Path) -> None:
    hosts = three_hosts(tmp_path)
    # Host 0 holds its own rank and a copy of host 1's; rank 2 is fetched from host 2.
    copy_snapshot(hosts[1].job_dir("job") / ".reported" / step_dir_name(50),
                  hosts[0].copies_root("job") / "host1" / step_dir_name(50))
    assert [list(s.ranks) for s in hosts[0].held("job")] == [[0, 1]]
    fetched: list[int] = []
    step_dir = hosts[0].assemble("job", 50, 3, fetcher(hosts[2], 50, fetched))
    assert fetched == [2]
    assert step_dir == hosts[0].job_dir("job") / ".resume" / step_dir_name(50)
    for rank, world in ((0, 3), (1, 2)):  # the same world, and a smaller one
        tensors, manifest = load_checkpoint(step_dir, rank, world)
        assert manifest.step == 50 and manifest.meta.consumed_samples == 400
        assert manifest.meta.skip_ledger == ((8, 16),) and manifest.generation == 3
        for name, expected in TENSORS.items():
            assert tensors[name].dtype == expected.dtype and np.array_equal(tensors[name], expected), name
    resharded = reshard_checkpoint(step_dir, tmp_path / "resharded", 2)
    tensors, _ = load_checkpoint(resharded, 1, 2)
    assert all(np.array_equal(tensors[name], expected) for name, expected in TENSORS.items())
    assert hosts[0].assemble("job", 50, 3, fetcher(hosts[2], 50, fetched)) == step_dir
    assert fetched == [2]  # reused: nothing fetched again


@pytest.mark.parametrize(("damage", "message"), [
    ("flipped", "damaged"), ("truncated", "rank 2's files are missing, incomplete"),
    ("generation", "different generations"), ("missing", "cannot fetch rank 2 of step 50: .*No such file"),
])
def test_an_assembly_refuses_damaged_or_foreign_files(tmp_path: Path, damage: str, message: str) -> None:
    hosts = three_hosts(tmp_path)
    pinned = hosts[2].job_dir("job") / ".reported" / step_dir_name(50)
    data, report = pinned / "rank_2.safetensors", pinned / "rank_2.done.json"
    content = bytearray(data.read_bytes())
    data.unlink()  # the pin is a hard link to the worker's file: damage a copy of it
    if damage == "flipped":
        content[-3] ^= 0x40
    data.write_bytes(content[:-7] if damage == "truncated" else content)
    if damage == "generation":
        body = json.loads(report.read_text())
        report.unlink()
        report.write_text(json.dumps(body | {"generation": 2}))
    if damage == "missing":
        report.unlink()

    def fetch(rank: int, into: Path) -> None:  # a peer sending what it has, whole or not
        source = hosts[rank].job_dir("job") / ".reported" / step_dir_name(50)
        for name in (f"rank_{rank}.safetensors", f"rank_{rank}.done.json"):
            shutil.copyfile(source / name, into / name)

    with pytest.raises(SnapshotAssemblyError, match=message) as caught:
        hosts[0].assemble("job", 50, 3, fetch)
    assert "\n" not in str(caught.value)
    assert list((hosts[0].job_dir("job") / ".resume").iterdir()) == []  # nothing half-assembled is left
