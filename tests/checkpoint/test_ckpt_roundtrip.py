"""Saving at N ranks and loading at M gives back every tensor bit for bit; the save protocol commits only
complete checkpoints, keeps `keep` of them, and the loader falls back past a damaged newest one.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from common.clock import FakeClock
from trainer.checkpoint import (
    CheckpointError,
    CheckpointMeta,
    CheckpointWriter,
    NoCheckpoint,
    export_safetensors,
    latest_verified,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    reshard_checkpoint,
    verify_checkpoint,
)
from trainer.checkpoint.manifest import MANIFEST_NAME, read_manifest

SaveAll = Callable[..., Path]


def _assert_bit_exact(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert set(actual) == set(expected)
    for name, array in expected.items():
        assert actual[name].dtype == array.dtype and actual[name].shape == array.shape, name
        assert actual[name].tobytes() == array.tobytes(), name


@pytest.mark.parametrize(("writers", "readers"), [(1, 2), (2, 3), (3, 2), (4, 1), (2, 4)])
def test_n_to_m_round_trip_is_bit_exact(
    tmp_path: Path,
    tensors: dict[str, np.ndarray],
    save_all: SaveAll,
    meta_for: Callable[[int], CheckpointMeta],
    writers: int,
    readers: int,
) -> None:
    step_dir = save_all(tmp_path, tensors, writers)
    manifest = read_manifest(step_dir)
    assert manifest.world_size == writers and manifest.meta == meta_for(100)
    assert sorted(f.name for f in manifest.files) == [f"rank_{r}.safetensors" for r in range(writers)]
    shard_dims = {"embed.weight": 1, "fc1.weight": 0, "half": 2}
    for rank in range(readers):
        whole, _ = load_checkpoint(step_dir, rank, readers)
        _assert_bit_exact(whole, tensors)
        sharded, _ = load_latest(tmp_path, rank, readers, shard_dims)
        expected = dict(tensors)
        for name, dim in shard_dims.items():
            expected[name] = np.array_split(tensors[name], readers, axis=dim)[rank]
        _assert_bit_exact(sharded, expected)


def test_replicated_tensors_are_written_once_spread_over_all_ranks(
    tmp_path: Path, tensors: dict[str, np.ndarray], save_all: SaveAll
) -> None:
    manifest = read_manifest(save_all(tmp_path, tensors, 3))
    payload = sum(a.nbytes for a in tensors.values())
    sizes = [f.size for f in manifest.files]
    assert sum(sizes) < payload * 1.01
    assert max(sizes) < payload / 3 * 1.5
    assert {c.file for c in manifest.tensors["embed.weight"].chunks} == {f.name for f in manifest.files}


def test_save_async_returns_after_the_copy_so_training_may_change_the_tensors(
    tmp_path: Path, tensors: dict[str, np.ndarray]
) -> None:
    expected = {name: array.copy() for name, array in tensors.items()}
    with CheckpointWriter(tmp_path, 0, 1) as writer:
        for step in (1, 2):
            writer.save_async(CheckpointMeta(step, 0, 0), tensors)
            for array in tensors.values():
                array[...] = 0  # the next training step overwrites the parameters in place
            assert writer.wait() == tmp_path / f"step_{step:08d}"
            for name, array in tensors.items():
                array[...] = expected[name]
    for step in (1, 2):
        _assert_bit_exact(load_checkpoint(tmp_path / f"step_{step:08d}", 0, 1)[0], expected)


def test_only_one_save_is_in_flight(tmp_path: Path, tensors: dict[str, np.ndarray]) -> None:
    # Rank 0 of 2 waits for rank 1, which never saves: the first save stays in flight until released,
    # then times out on the fake clock.
    release = threading.Event()

    class HeldClock(FakeClock):
        def sleep(self, seconds: float) -> None:
            release.wait()
            super().sleep(seconds)

    writer = CheckpointWriter(tmp_path, 0, 2, commit_timeout_s=1, clock=HeldClock())
    writer.save_async(CheckpointMeta(1, 0, 0), tensors)
    outcome: list[BaseException] = []

    def second_save() -> None:
        try:
            writer.save_async(CheckpointMeta(2, 0, 0), tensors)
        except CheckpointError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=second_save)
    thread.start()
    thread.join(0.5)
    assert thread.is_alive(), "a second save started while the first was in flight"
    release.set()
    thread.join(10)
    assert "ranks [1] did not finish writing" in str(outcome[0])
    assert not (tmp_path / "step_00000002").exists()
    writer.close()


def test_rank_0_commits_only_when_every_rank_of_its_generation_has_written(
    tmp_path: Path, tensors: dict[str, np.ndarray], save_all: SaveAll
) -> None:
    # A dead launch (generation 1, world size 2) left rank 1's file and report at step 100.
    with CheckpointWriter(tmp_path, 1, 2, generation=1) as stale:
        stale.save(CheckpointMeta(100, 0, 0), tensors)
    rank_0 = CheckpointWriter(tmp_path, 0, 2, generation=2, commit_timeout_s=30, clock=FakeClock())
    with rank_0 as writer:
        writer.save_async(CheckpointMeta(100, 0, 0), tensors)
        with pytest.raises(CheckpointError, match=r"ranks \[1\] did not finish writing within 30 s; not committed"):
            writer.wait()
    assert not (tmp_path / "step_00000100" / MANIFEST_NAME).exists()
    assert not list_checkpoints(tmp_path)[0].complete
    # The same step saved again by the whole of generation 3 commits and drops the leftovers.
    step_dir = save_all(tmp_path, tensors, 2, generation=3)
    assert read_manifest(step_dir).generation == 3
    assert sorted(p.name for p in step_dir.iterdir()) == [MANIFEST_NAME, "rank_0.safetensors", "rank_1.safetensors"]


def test_a_rank_out_of_space_makes_rank_0_give_the_step_up_at_once_and_the_next_save_commits(
    tmp_path: Path, tensors: dict[str, np.ndarray]
) -> None:
    """Rank 1's file cannot be written (its temporary file is /dev/full: ENOSPC): rank 0 does not wait out its
    commit timeout (the clock never moves), the step is not committed, and the next save of both commits."""
    step_dir = tmp_path / "step_00000002"
    step_dir.mkdir()
    (step_dir / ".rank_1.safetensors.tmp").symlink_to("/dev/full")
    ranks = [CheckpointWriter(tmp_path, r, 2, generation=4, commit_timeout_s=30, clock=FakeClock()) for r in range(2)]
    ranks[1].save_async(CheckpointMeta(2, 0, 0), tensors)
    with pytest.raises(CheckpointError, match="No space left on device"):
        ranks[1].wait()
    ranks[0].save_async(CheckpointMeta(2, 0, 0), tensors)
    with pytest.raises(CheckpointError, match=r"step_00000002: ranks \[1\] could not write their share; not committed"):
        ranks[0].wait()
    assert not (step_dir / MANIFEST_NAME).exists()
    ranks[1].save_async(CheckpointMeta(4, 0, 0), tensors)
    # Its share written before rank 0 waits for it: rank 0 waits in fake time, polling, and a share still
    # being written by a thread slowed down by a loaded machine ran out its 30 fake seconds (seen in CI).
    ranks[1].wait()
    ranks[0].save_async(CheckpointMeta(4, 0, 0), tensors)
    assert ranks[0].wait() == tmp_path / "step_00000004"
    verify_checkpoint(tmp_path / "step_00000004")
    assert not step_dir.exists()  # retention removed the failed save's leftovers
    for writer in ranks:
        writer.close()


def test_a_share_placed_in_a_second_root_is_the_same_file_and_outlives_the_commit(
    tmp_path: Path, tensors: dict[str, np.ndarray]
) -> None:
    """`share_into` (a snapshot handing its share to the agent's outbox): each rank's data file is linked, not
    copied, and its report stays there after rank 0's commit removed the reports beside the manifest; the
    future is done once the share is there, before the commit."""
    snapshots, outbox = tmp_path / "memory", tmp_path / "memory" / ".outbox"
    ranks = [CheckpointWriter(snapshots, r, 2, generation=5) for r in range(2)]
    shared = [ranks[1].save_async(CheckpointMeta(6, 96, 1), tensors, share_into=outbox)]
    shared.insert(0, ranks[0].save_async(CheckpointMeta(6, 96, 1), tensors, share_into=outbox))
    for future in shared:
        assert future.result(timeout=30) is None
    assert ranks[0].wait() == snapshots / "step_00000006"
    verify_checkpoint(snapshots / "step_00000006")
    share = outbox / "step_00000006"
    assert sorted(os.listdir(share)) == ["rank_0.done.json", "rank_0.safetensors", "rank_1.done.json",
                                         "rank_1.safetensors"]
    for rank in range(2):
        assert os.stat(share / f"rank_{rank}.safetensors").st_ino == os.stat(
            snapshots / "step_00000006" / f"rank_{rank}.safetensors").st_ino
    report = json.loads((share / "rank_1.done.json").read_text())
    assert (report["rank"], report["step"], report["generation"], report["meta"]["consumed_samples"]) == (1, 6, 5, 96)

    # A share that cannot be placed (the outbox is a file) fails its future and is marked failed where the
    # agent looks (here: nowhere to mark); the snapshot itself still commits.
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    futures = [writer.save_async(CheckpointMeta(8, 128, 1), tensors, share_into=blocked) for writer in reversed(ranks)]
    for future in futures:
        with pytest.raises(CheckpointError, match=r"could not place its share of step 8 in .*blocked"):
            future.result(timeout=30)
    assert ranks[0].wait() == snapshots / "step_00000008"
    verify_checkpoint(snapshots / "step_00000008")
    for writer in ranks:
        writer.close()


def test_ranks_that_disagree_on_a_tensor_are_not_committed(tmp_path: Path) -> None:
    ranks = [CheckpointWriter(tmp_path, r, 2, commit_timeout_s=10) for r in range(2)]
    ranks[1].save_async(CheckpointMeta(5, 0, 0), {"w": np.zeros((4, 3), np.float32)})
    ranks[0].save_async(CheckpointMeta(5, 0, 0), {"w": np.zeros((4, 3), np.float64)})
    with pytest.raises(CheckpointError, match="tensor 'w': rank 1 saved F32 \\[4, 3\\], rank 0 F64 \\[4, 3\\]"):
        ranks[0].wait()
    ranks[1].close()
    assert not (tmp_path / "step_00000005" / MANIFEST_NAME).exists()


def test_retention_keeps_the_newest_complete_checkpoints(tmp_path: Path, tensors: dict[str, np.ndarray]) -> None:
    (tmp_path / "step_00000003").mkdir()  # a save that never finished
    with CheckpointWriter(tmp_path, 0, 1, keep=2) as writer:
        for step in (2, 4, 6, 8):
            writer.save(CheckpointMeta(step, 0, 0), tensors)
    assert [(i.step, i.complete) for i in list_checkpoints(tmp_path)] == [(6, True), (8, True)]


def test_loader_falls_back_past_a_damaged_or_incomplete_newest_checkpoint_and_says_so(
    tmp_path: Path, tensors: dict[str, np.ndarray], save_all: SaveAll, caplog: pytest.LogCaptureFixture
) -> None:
    save_all(tmp_path, tensors, 2, step=10)
    newer = save_all(tmp_path, {**tensors, "global_step": np.array(99, np.int32)}, 2, step=20)
    (tmp_path / "step_00000030").mkdir()  # incomplete: no manifest
    rank_file = newer / "rank_1.safetensors"
    data = bytearray(rank_file.read_bytes())
    data[-1] ^= 0x01
    rank_file.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        loaded, manifest = load_latest(tmp_path, 0, 3)
    assert manifest.step == 10
    _assert_bit_exact(loaded, tensors)
    assert "step_00000030" in caplog.text and "manifest.json is missing" in caplog.text
    assert re.search(r"step_00000020/rank_1.safetensors: key '.*' segment \d+: checksum does not match", caplog.text)
    assert latest_verified(tmp_path) == (tmp_path / "step_00000010", manifest)


def test_no_usable_checkpoint_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "step_00000001").mkdir()
    with pytest.raises(NoCheckpoint):
        load_latest(tmp_path, 0, 1)


def test_offline_reshard_and_export_keep_every_bit(
    tmp_path: Path, tensors: dict[str, np.ndarray], save_all: SaveAll, meta_for: Callable[[int], CheckpointMeta]
) -> None:
    source = save_all(tmp_path / "src", tensors, 3)
    resharded = reshard_checkpoint(source, tmp_path / "out", 2)
    manifest = read_manifest(resharded)
    assert (manifest.world_size, manifest.meta) == (2, meta_for(100))
    _assert_bit_exact(load_checkpoint(resharded, 1, 5)[0], tensors)
    export_safetensors(resharded, tmp_path / "model.safetensors")
    _assert_bit_exact(load_file(tmp_path / "model.safetensors"), tensors)


def test_a_filesystem_that_refuses_o_direct_gets_buffered_writes(
    tmp_path: Path, tensors: dict[str, np.ndarray], save_all: SaveAll, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open
    refused = []

    def open_without_direct(path: str | Path, flags: int, *args: int, **kwargs: int | None) -> int:
        if flags & os.O_DIRECT:
            refused.append(path)
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_without_direct)
    step_dir = save_all(tmp_path, tensors, 2)
    monkeypatch.undo()
    assert len(refused) == 2
    _assert_bit_exact(load_checkpoint(step_dir, 0, 1)[0], tensors)


_DTYPES = [np.float32, np.float64, np.float16, np.int8, np.int64, np.uint16, np.bool_]


@st.composite
def _models(draw: st.DrawFn) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(draw(st.integers(0, 1000)))
    model = {}
    for index in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(0, 12), min_size=0, max_size=3)))
        dtype = np.dtype(draw(st.sampled_from(_DTYPES)))
        model[f"t{index}"] = np.asarray(rng.standard_normal(shape) * 50).astype(dtype)
    return model


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_models(), st.integers(1, 4), st.integers(1, 4), st.data())
def test_files_round_trip_for_random_models_shardings_and_small_segments(
    model: dict[str, np.ndarray], writers: int, readers: int, data: st.DataObject
) -> None:
    # Tiny pieces and segments so that chunks split across ranks and reads start and end inside segments.
    with mock.patch("trainer.checkpoint.sharding.MIN_PIECE_BYTES", 16), mock.patch(
        "trainer.checkpoint.digest.SEGMENT_BYTES", data.draw(st.sampled_from([8, 24, 100]))
    ), tempfile.TemporaryDirectory() as root:
        ranks = [CheckpointWriter(root, rank, writers) for rank in range(writers)]
        for writer in ranks:
            writer.save_async(CheckpointMeta(1, 0, 0), model)
        step_dir = [writer.wait() for writer in ranks][0]
        for writer in ranks:
            writer.close()
        shard_dims = {
            name: data.draw(st.integers(0, array.ndim - 1)) for name, array in model.items() if array.ndim
        }
        for rank in range(readers):
            loaded, _ = load_checkpoint(step_dir, rank, readers, shard_dims)
            for name, array in model.items():
                expected = np.array_split(array, readers, axis=shard_dims[name])[rank] if name in shard_dims else array
                assert loaded[name].dtype == expected.dtype and loaded[name].shape == expected.shape
                assert loaded[name].tobytes() == expected.tobytes()
        verify_checkpoint(step_dir)
