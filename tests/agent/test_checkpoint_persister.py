"""Disk checkpoints the agent saves from its workers' outbox (agent/snapshots/checkpoint_persister.py,
`checkpoint.saved_by: agent`): real files written by the real checkpoint writer, a real tmpfs for the full
disk, real threads for the hosts that save together."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from agent.commands import Launch, Stop
from agent.snapshots.checkpoint_persister import CheckpointPersister, Outbox, PersistedSave, UnpersistedSave
from agent.snapshots.memory_snapshots import MemorySnapshotDir, step_dir_name
from agent.thread_priority import BACKGROUND_NICENESS
from agent.worker_user import WorkerUser
from proto import trainerd_pb2 as pb
from tests.agent.snapshot_files import TENSORS, host_snapshot
from tests.agent.supervisor_fakes import Host, run
from tests.agent.test_memory_snapshots import memory_launch
from tests.waiting import wait_until
from trainer.checkpoint import CheckpointMeta, CheckpointWriter, load_checkpoint, reshard_checkpoint
from trainer.checkpoint.export import export_safetensors
from trainer.checkpoint.manifest import read_manifest
from trainer.checkpoint.verify import verify_checkpoint

GENERATION = 3


class Heard:
    """What the persister told the agent."""

    def __init__(self) -> None:
        self.saved: list[PersistedSave] = []
        self.failed: list[UnpersistedSave] = []

    def persister(self, outbox: Outbox, **kwargs: float) -> CheckpointPersister:
        return CheckpointPersister(outbox, self.saved.append, self.failed.append, **kwargs)


def outbox_of(tmp_path: Path, checkpoints: Path, ranks: tuple[int, ...], world_size: int, keep: int = 3,
              host: str = "host") -> Outbox:
    directory = tmp_path / host / ".outbox"
    directory.mkdir(parents=True)
    return Outbox(directory, checkpoints, ranks, world_size, GENERATION, keep)


def test_a_saved_checkpoint_is_the_one_the_workers_would_have_written(tmp_path: Path) -> None:
    """Byte for byte: the data files and the manifest; and it verifies, reshards, loads and exports."""
    heard = Heard()
    outbox = outbox_of(tmp_path, tmp_path / "by-agent", (0, 1), world_size=2)
    share = host_snapshot(outbox.directory, 50, (0, 1), world_size=2, generation=GENERATION)
    assert heard.persister(outbox).persist_ready() == 1
    saved = tmp_path / "by-agent" / step_dir_name(50)
    assert heard.saved == [PersistedSave(GENERATION, 50, 400, saved)] and heard.failed == []
    assert not share.exists()  # taken: the workers may hand over the next

    meta = CheckpointMeta(step=50, consumed_samples=400, data_seed=1, skip_ledger=((8, 16),))
    for rank in (1, 0):  # rank 0 commits once rank 1's report is there
        with CheckpointWriter(tmp_path / "by-workers", rank, 2, generation=GENERATION) as writer:
            writer.save(meta, TENSORS)
    written = tmp_path / "by-workers" / step_dir_name(50)
    assert sorted(os.listdir(saved)) == sorted(os.listdir(written)) == ["manifest.json", "rank_0.safetensors",
                                                                        "rank_1.safetensors"]
    for name in os.listdir(written):
        assert (saved / name).read_bytes() == (written / name).read_bytes(), name

    assert verify_checkpoint(saved).step == 50
    for rank, world in ((0, 1), (2, 3)):
        tensors, manifest = load_checkpoint(saved, rank, world)
        assert manifest.meta.skip_ledger == ((8, 16),)
        assert all(np.array_equal(tensors[name], expected) for name, expected in TENSORS.items())
    tensors, _ = load_checkpoint(reshard_checkpoint(saved, tmp_path / "resharded", 3), 1, 3)
    assert all(np.array_equal(tensors[name], expected) for name, expected in TENSORS.items())
    export_safetensors(saved, tmp_path / "model.safetensors")
    export_safetensors(written, tmp_path / "model-by-workers.safetensors")
    assert (tmp_path / "model.safetensors").read_bytes() == (tmp_path / "model-by-workers.safetensors").read_bytes()


def test_hosts_save_their_own_ranks_and_rank_0s_agent_commits_and_prunes(tmp_path: Path) -> None:
    """Two hosts' persisters running as threads over one checkpoint directory; retention keeps two."""
    checkpoints = tmp_path / "checkpoints"
    heard = [Heard(), Heard()]
    outboxes = [outbox_of(tmp_path, checkpoints, (0, 1), 4, keep=2, host="host0"),
                outbox_of(tmp_path, checkpoints, (2, 3), 4, keep=2, host="host1")]
    persisters = [h.persister(o, poll_interval_s=0.01) for h, o in zip(heard, outboxes)]
    for persister in persisters:
        persister.start()
    try:
        for step in (10, 20, 30):
            host_snapshot(outboxes[0].directory, step, (0, 1), world_size=4, generation=GENERATION)
            # Host 1 hands its share over later: host 0's agent waits for its report before it commits.
            threading.Timer(0.2, host_snapshot, (outboxes[1].directory, step, (2, 3), 4, GENERATION)).start()
            wait_until(lambda n=step // 10: len(heard[0].saved) == n, 30, f"the commit of step {step}")
    finally:
        for persister in persisters:
            persister.stop()
    assert [s.step for s in heard[0].saved] == [10, 20, 30] and heard[1].saved == []  # only rank 0's agent
    assert heard[0].failed == heard[1].failed == []
    assert sorted(os.listdir(checkpoints)) == [step_dir_name(20), step_dir_name(30)]
    assert read_manifest(checkpoints / step_dir_name(30)).world_size == 4
    tensors, _ = load_checkpoint(checkpoints / step_dir_name(30), 0, 1)
    assert all(np.array_equal(tensors[name], expected) for name, expected in TENSORS.items())
    assert [list(o.directory.iterdir()) for o in outboxes] == [[], []]


def flip_a_byte(share: Path) -> None:
    data = share / "rank_1.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(bytes(raw))


def link_instead(share: Path) -> None:
    data = share / "rank_1.safetensors"
    kept = share.parent / "elsewhere"
    data.rename(kept)
    data.symlink_to(kept)


def test_stopping_the_generation_ends_the_wait_for_another_hosts_share(tmp_path: Path) -> None:
    """Rank 0's agent waits for a host that will never hand its share over (it was lost): the Stop of the
    generation ends the wait at once, and nothing is committed or reported."""
    heard = Heard()
    outbox = outbox_of(tmp_path, tmp_path / "checkpoints", (0,), world_size=2)
    persister = heard.persister(outbox, poll_interval_s=0.01)
    persister.start()
    host_snapshot(outbox.directory, 50, (0,), world_size=2, generation=GENERATION)
    checkpoint = tmp_path / "checkpoints" / step_dir_name(50)
    wait_until(lambda: (checkpoint / "rank_0.done.json").exists(), 10, "rank 0's share on disk")
    stopped_at = time.monotonic()
    persister.stop()
    assert time.monotonic() - stopped_at < 5  # not the 600 s commit timeout
    assert heard.saved == heard.failed == [] and not (checkpoint / "manifest.json").exists()


def test_what_the_agent_writes_belongs_to_the_workers_user(tmp_path: Path, shared_dir: Path,
                                                           worker_user: WorkerUser) -> None:
    heard = Heard()
    checkpoints = shared_dir / "checkpoints"
    outbox = replace(outbox_of(tmp_path, checkpoints, (0, 1), world_size=2), owner=worker_user)
    host_snapshot(outbox.directory, 50, (0, 1), world_size=2, generation=GENERATION)
    assert heard.persister(outbox).persist_ready() == 1 and len(heard.saved) == 1
    step_dir = checkpoints / step_dir_name(50)
    for path in (checkpoints, step_dir, *step_dir.iterdir()):
        assert (path.stat().st_uid, path.stat().st_gid) == (worker_user.uid, worker_user.gid), path


def test_a_damaged_share_is_never_committed(tmp_path: Path) -> None:
    heard = Heard()
    outbox = outbox_of(tmp_path, tmp_path / "checkpoints", (0, 1), world_size=2)
    share = host_snapshot(outbox.directory, 50, (0, 1), world_size=2, generation=GENERATION)
    flip_a_byte(share)  # the size is right: only the copy's checksums tell
    assert heard.persister(outbox).persist_ready() == 1
    assert heard.saved == [] and len(heard.failed) == 1
    failure = heard.failed[0]
    assert (failure.generation, failure.rank, failure.step) == (GENERATION, 1, 50)
    assert "checksum does not match" in failure.reason
    assert not (tmp_path / "checkpoints" / step_dir_name(50) / "manifest.json").exists()
    assert not share.exists()  # removed all the same: the workers are not held up

    host_snapshot(outbox.directory, 60, (0, 1), world_size=2, generation=GENERATION)
    assert heard.persister(outbox).persist_ready() == 1
    assert [s.step for s in heard.saved] == [60]


def test_a_share_of_another_generation_an_incomplete_step_or_a_link_is_not_taken(tmp_path: Path) -> None:
    heard = Heard()
    outbox = outbox_of(tmp_path, tmp_path / "checkpoints", (0, 1), world_size=2)
    host_snapshot(outbox.directory, 40, (0, 1), world_size=2, generation=GENERATION - 1)
    host_snapshot(outbox.directory, 50, (0,), world_size=2, generation=GENERATION)  # rank 1 still writing
    link_instead(host_snapshot(outbox.directory, 45, (0, 1), world_size=2, generation=GENERATION))
    persister = heard.persister(outbox)
    assert persister.persist_ready() == 0 and heard.saved == heard.failed == []
    host_snapshot(outbox.directory, 50, (1,), world_size=2, generation=GENERATION)
    assert persister.persist_ready() == 1 and [s.step for s in heard.saved] == [50]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [step_dir_name(50)]


def test_a_step_a_local_rank_could_not_hand_over_is_given_up_at_once_and_the_other_hosts_told(
        tmp_path: Path) -> None:
    """Rank 2 (this host has 1 and 2) marked its share failed: the step leaves the outbox at once, so rank 1
    is not held up waiting for it to be taken, and rank 0's agent on another host finds the marks and gives
    the step up too, rather than waiting out its commit timeout. The worker reported the failure itself."""
    heard, rank_0s = Heard(), Heard()
    checkpoints = tmp_path / "checkpoints"
    outbox = outbox_of(tmp_path, checkpoints, (1, 2), world_size=3)
    share = host_snapshot(outbox.directory, 50, (1,), world_size=3, generation=GENERATION)
    (share / f"rank_2.failed.{GENERATION}").touch()
    assert heard.persister(outbox).persist_ready() == 1
    assert not share.exists() and heard.saved == heard.failed == []
    head = outbox_of(tmp_path, checkpoints, (0,), world_size=3, host="head")
    host_snapshot(head.directory, 50, (0,), world_size=3, generation=GENERATION)
    assert rank_0s.persister(head, commit_timeout_s=600).persist_ready() == 1  # at once, not after 600 s
    assert rank_0s.saved == [] and "could not write their share" in rank_0s.failed[0].reason
    assert not (checkpoints / step_dir_name(50) / "manifest.json").exists()


def test_a_step_still_waiting_for_a_share_is_read_again_only_once_its_directory_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hostile or slow worker can leave steps unfinished: their reports are not re-read every poll."""
    import agent.snapshots.checkpoint_persister as persister_module

    reads: list[int] = []
    real_read = persister_module.read_report
    monkeypatch.setattr(persister_module, "read_report",
                        lambda source, rank, step: reads.append(step) or real_read(source, rank, step))
    heard = Heard()
    outbox = outbox_of(tmp_path, tmp_path / "checkpoints", (0, 1), world_size=2)
    share = host_snapshot(outbox.directory, 50, (0,), world_size=2, generation=GENERATION)  # rank 1 missing
    settled = time.time() - 5
    os.utime(share, (settled, settled))
    persister = heard.persister(outbox)
    for _ in range(5):
        assert persister.persist_ready() == 0
    assert reads == [50, 50]  # one pass read both ranks' reports; the other four read nothing
    host_snapshot(outbox.directory, 50, (1,), world_size=2, generation=GENERATION)
    assert persister.persist_ready() == 1 and [s.step for s in heard.saved] == [50]


def test_a_step_directory_changed_within_the_last_second_is_read_again_every_poll(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A share that lands within the file system's clock tick of the previous one may leave the directory's
    modification time as it was: until the directory has been still for a second, nothing is cached."""
    import agent.snapshots.checkpoint_persister as persister_module

    reads: list[int] = []
    real_read = persister_module.read_report
    monkeypatch.setattr(persister_module, "read_report",
                        lambda source, rank, step: reads.append(step) or real_read(source, rank, step))
    outbox = outbox_of(tmp_path, tmp_path / "checkpoints", (0, 1), world_size=2)
    share = host_snapshot(outbox.directory, 50, (0,), world_size=2, generation=GENERATION)  # rank 1 missing
    fresh = time.time() + 30  # changed "now" for the next 30 s, however slow this machine is
    os.utime(share, (fresh, fresh))
    persister = Heard().persister(outbox)
    for _ in range(3):
        assert persister.persist_ready() == 0
    assert reads == [50, 50] * 3  # its modification time is unchanged, and still every pass read it


def test_a_full_disk_fails_the_save_cleanly_and_saving_resumes_once_there_is_room(
        tmp_path: Path, mount_tmpfs: Callable[[str, str], Path]) -> None:
    checkpoints = mount_tmpfs("small-disk", "1m")
    filler = checkpoints / "filler"
    filler.write_bytes(b"\0" * (1024 * 1024 - 8192))
    heard = Heard()
    outbox = outbox_of(tmp_path, checkpoints, (0, 1), world_size=2)
    big = {"embed": np.ones((256, 256), np.float32)}  # 256 KiB a rank's share would not fit
    host_snapshot(outbox.directory, 10, (0, 1), world_size=2, generation=GENERATION, tensors=big)
    persister = heard.persister(outbox)
    assert persister.persist_ready() == 1
    assert heard.saved == [] and "No space left on device" in heard.failed[0].reason
    assert not (checkpoints / step_dir_name(10) / "manifest.json").exists()
    assert not list((checkpoints / step_dir_name(10)).glob(".*.tmp"))  # no partial file left behind

    filler.unlink()
    host_snapshot(outbox.directory, 20, (0, 1), world_size=2, generation=GENERATION, tensors=big)
    assert persister.persist_ready() == 1
    assert [s.step for s in heard.saved] == [20]
    assert verify_checkpoint(checkpoints / step_dir_name(20)).step == 20


def saving_launch(generation: int, checkpoints: Path, saved_by: str = "agent") -> Launch:
    return memory_launch(generation, TRAINERD_MEMORY_EVERY="0", TRAINERD_RESUME_STEP="", RANK_SIZE="2",
                         TRAINERD_CHECKPOINT_DIR=str(checkpoints), TRAINERD_CHECKPOINT_KEEP="3",
                         TRAINERD_CHECKPOINT_SAVED_BY=saved_by)


def test_the_supervisor_names_the_outbox_and_reports_what_its_agent_saved(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"

    async def scenario() -> None:
        host = Host(tmp_path / "work", memory=MemorySnapshotDir(tmp_path / "shm"))
        (tmp_path / "work").mkdir()
        await host.supervisor.launch(saving_launch(GENERATION, checkpoints))
        outbox = Path(host.launcher.started["rank1"].env["TRAINERD_CHECKPOINT_OUTBOX"])
        assert outbox == tmp_path / "shm" / "job" / ".outbox" and outbox.is_dir()
        host_snapshot(outbox, 50, (0, 1), world_size=2, generation=GENERATION)
        while not host.sent("checkpoint_saved"):
            await asyncio.sleep(0.02)
        assert host.sent("checkpoint_saved") == [pb.CheckpointSaved(
            generation=GENERATION, step=50, consumed_samples=400, path=str(checkpoints / step_dir_name(50)))]
        await host.supervisor.stop(Stop(generation=GENERATION, grace_s=1.0))
        # The generation is over: what its workers hand over now is not saved, and the next launch clears it.
        host_snapshot(outbox, 60, (0, 1), world_size=2, generation=GENERATION)
        await asyncio.sleep(0.2)
        assert not (checkpoints / step_dir_name(60)).exists()
        await host.supervisor.launch(saving_launch(GENERATION + 1, checkpoints, saved_by="worker"))
        env = host.launcher.started["rank1"].env
        assert "TRAINERD_CHECKPOINT_OUTBOX" not in env and not outbox.exists()

    run(scenario())
    assert verify_checkpoint(checkpoints / step_dir_name(50)).step == 50


def test_an_agent_without_shared_memory_leaves_the_saving_to_the_workers(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path / "work")
        (tmp_path / "work").mkdir()
        await host.supervisor.launch(saving_launch(1, tmp_path / "checkpoints"))
        assert "TRAINERD_CHECKPOINT_OUTBOX" not in host.launcher.started["rank1"].env

    run(scenario())


def test_the_persister_yields_the_cores_to_training(tmp_path: Path) -> None:
    """Its thread runs at the lowest priority; the rest of the agent (its event loop) keeps its own."""
    priorities: list[int] = []
    own = os.getpriority(os.PRIO_PROCESS, 0)  # on Linux, the calling thread's
    outbox = outbox_of(tmp_path, tmp_path / "checkpoints", (0,), world_size=1)
    persister = CheckpointPersister(
        outbox, lambda saved: priorities.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())),
        lambda failed: pytest.fail(failed.reason), poll_interval_s=0.01)
    persister.start()
    try:
        host_snapshot(outbox.directory, 10, (0,), world_size=1, generation=GENERATION)
        wait_until(lambda: priorities, 10, "the save")
    finally:
        persister.stop()
    assert priorities == [BACKGROUND_NICENESS] and os.getpriority(os.PRIO_PROCESS, 0) == own
