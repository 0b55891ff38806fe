"""Damaged and hostile checkpoints: each is refused with a clear error, the loader falls back to the previous
complete checkpoint, and reshard/export leave nothing that looks complete and nothing outside their output.
Nothing is read through a symbolic link, nothing but a regular file is read, and a resume reads only from
the job's own checkpoint directory.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from trainer.checkpoint import (
    CheckpointError,
    CorruptCheckpoint,
    export_safetensors,
    import_native,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    reshard_checkpoint,
    verify_checkpoint,
    write_resharded,
)
from trainer.checkpoint.file_access import open_regular_file
from trainer.checkpoint.manifest import MANIFEST_NAME, read_manifest
from trainer.checkpoint.retention import prune
from trainer.checkpoint.step_dirs import check_inside_root
from trainer.runtime.checkpointing import CheckpointUnreadable, TrainingCheckpoints
from trainer.runtime.rank_context import RankCheckpointSettings, RankContext

GOOD, BAD = "step_00000010", "step_00000020"


def _edit_manifest(step_dir: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    path = step_dir / MANIFEST_NAME
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document))


def _truncate(step_dir: Path) -> None:
    path = step_dir / "rank_1.safetensors"
    os.truncate(path, path.stat().st_size - 100)


def _flip_byte(step_dir: Path) -> None:
    path = step_dir / "rank_0.safetensors"
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


def _missing_file(step_dir: Path) -> None:
    (step_dir / "rank_1.safetensors").unlink()


def _escaping_name(step_dir: Path) -> None:
    def edit(document: dict[str, Any]) -> None:
        document["files"][1]["name"] = f"../{GOOD}/rank_1.safetensors"
        for layout in document["tensors"].values():
            for chunk in layout["chunks"]:
                if chunk["file"] == "rank_1.safetensors":
                    chunk["file"] = f"../{GOOD}/rank_1.safetensors"

    _edit_manifest(step_dir, edit)


def _escaping_symlink(step_dir: Path) -> None:
    outside = step_dir.parent.parent / "outside.safetensors"
    (step_dir / "rank_1.safetensors").rename(outside)
    (step_dir / "rank_1.safetensors").symlink_to(outside)


def _symlink_inside(step_dir: Path) -> None:
    (step_dir / "rank_1.safetensors").rename(step_dir / "rank_1.real")
    (step_dir / "rank_1.safetensors").symlink_to("rank_1.real")


def _symlinked_manifest(step_dir: Path) -> None:
    elsewhere = step_dir.parent.parent / "manifest-elsewhere.json"
    (step_dir / MANIFEST_NAME).rename(elsewhere)
    (step_dir / MANIFEST_NAME).symlink_to(elsewhere)


def _symlinked_step_dir(step_dir: Path) -> None:
    elsewhere = step_dir.parent.parent / "elsewhere" / step_dir.name
    elsewhere.parent.mkdir()
    step_dir.rename(elsewhere)
    step_dir.symlink_to(elsewhere, target_is_directory=True)


def _fifo_rank_file(step_dir: Path) -> None:
    (step_dir / "rank_1.safetensors").unlink()
    os.mkfifo(step_dir / "rank_1.safetensors")


def _absurd_shape(step_dir: Path) -> None:
    def edit(document: dict[str, Any]) -> None:
        layout = document["tensors"]["fc1.weight"]
        layout["shape"] = [1 << 46, 1 << 46]
        layout["chunks"] = [
            dict(
                layout["chunks"][0], offsets=[0, 0], sizes=[1 << 46, 1 << 46], segment_rows=1 << 46, checksums=["0" * 8]
            )
        ]

    _edit_manifest(step_dir, edit)


def _absurd_offset(step_dir: Path) -> None:
    _edit_manifest(step_dir, lambda d: d["tensors"]["fc1.bias"]["chunks"][0].update(offsets=[1 << 40]))


def _header_claims_gigabytes(step_dir: Path) -> None:
    with open(step_dir / "rank_1.safetensors", "r+b") as f:
        f.write(struct.pack("<Q", 3 << 30))


def _header_byte_flipped(step_dir: Path) -> None:
    with open(step_dir / "rank_0.safetensors", "r+b") as f:
        f.seek(20)
        byte = f.read(1)
        f.seek(20)
        f.write(bytes([byte[0] ^ 0x01]))


def _manifest_dtype_disagrees_with_header(step_dir: Path) -> None:
    _edit_manifest(step_dir, lambda d: d["tensors"]["half"].update(dtype="I16"))


def _manifest_not_json(step_dir: Path) -> None:
    (step_dir / MANIFEST_NAME).write_text('{"schema": 1, "step": ')


def _manifest_huge(step_dir: Path) -> None:
    os.truncate(step_dir / MANIFEST_NAME, 65 << 20)


DAMAGE = {
    "truncated file": (_truncate, "rank_1.safetensors is .* bytes, the manifest says .* \\(truncated or replaced\\)"),
    "flipped byte": (_flip_byte, "rank_0.safetensors: key '.*' segment \\d+: checksum does not match the manifest"),
    "missing file": (_missing_file, "rank_1.safetensors is listed in the manifest but missing"),
    "path escapes": (_escaping_name, "is not a plain relative path inside the checkpoint"),
    "symlink escapes": (_escaping_symlink, "step_00000020/rank_1.safetensors is a symbolic link"),
    "symlink inside": (_symlink_inside, "step_00000020/rank_1.safetensors is a symbolic link"),
    "symlinked manifest": (_symlinked_manifest, "step_00000020/manifest.json is a symbolic link"),
    "symlinked step directory": (_symlinked_step_dir, "/ckpt/step_00000020 is a symbolic link"),
    "FIFO rank file": (_fifo_rank_file, "step_00000020/rank_1.safetensors is not a regular file but a FIFO"),
    "absurd shape": (_absurd_shape, "its chunks need"),
    "absurd offset": (_absurd_offset, "tensor 'fc1.bias': chunk 0 .* lies outside shape \\[300\\]"),
    "header claims gigabytes": (
        _header_claims_gigabytes, "rank_1.safetensors: its safetensors header claims 3221225472"
    ),
    "header byte flipped": (_header_byte_flipped, "rank_0.safetensors: the digest of its header does not match"),
    "dtype disagrees": (
        _manifest_dtype_disagrees_with_header, "key 'half' holds F16 \\[33, 7, 5\\], the manifest says I16"
    ),
    "manifest not JSON": (_manifest_not_json, "manifest.json is not valid JSON"),
    "manifest huge": (_manifest_huge, "more than the 67108864 a manifest.json may have"),
}


@pytest.fixture
def checkpoints(tmp_path: Path, tensors: dict[str, np.ndarray], save_all: Callable[..., Path]) -> Path:
    root = tmp_path / "ckpt"
    save_all(root, tensors, 2, step=10)
    save_all(root, tensors, 2, step=20)
    return root


def _files_under(path: Path) -> set[Path]:
    return {p for p in path.rglob("*")}


@pytest.mark.parametrize("case", DAMAGE)
def test_damage_is_refused_everywhere_and_the_loader_falls_back(
    checkpoints: Path, tensors: dict[str, np.ndarray], case: str, caplog: pytest.LogCaptureFixture
) -> None:
    damage, message = DAMAGE[case]
    bad = checkpoints / BAD
    damage(bad)
    with pytest.raises(CorruptCheckpoint, match=message) as refused:
        verify_checkpoint(bad)
    assert "\n" not in str(refused.value)
    with pytest.raises(CorruptCheckpoint):
        load_checkpoint(bad, 0, 3)
    with caplog.at_level(logging.WARNING):
        loaded, manifest = load_latest(checkpoints, 0, 3)
    assert manifest.step == 10 and BAD in caplog.text
    assert all(loaded[name].tobytes() == array.tobytes() for name, array in tensors.items())

    before = _files_under(checkpoints.parent)
    out = checkpoints.parent / "out"
    out.mkdir()
    with pytest.raises(CorruptCheckpoint):
        reshard_checkpoint(bad, out, 3)
    with pytest.raises(CorruptCheckpoint):
        export_safetensors(bad, out / "model.safetensors")
    assert _files_under(checkpoints.parent) == before | {out}, "something was written"


def test_a_reshard_that_fails_half_way_leaves_no_output(checkpoints: Path) -> None:
    manifest = read_manifest(checkpoints / BAD)
    _truncate(checkpoints / BAD)  # write_resharded trusts its caller to have verified the source
    out = checkpoints.parent / "out"
    with pytest.raises(CorruptCheckpoint):
        write_resharded(checkpoints / BAD, manifest.tensors, manifest.meta, out, 3)
    assert list(out.iterdir()) == []


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({"opt_weight_shard_step": 1, "opt_weight_shard_size": 2}, "optimizer shard size 2 does not divide the 1 ranks"),
        ({"param_split_shape": [3, 5]}, "uneven splits .* cannot be represented"),
        ({"dev_matrix": [4]}, "has 2 rank directories but the strategy describes 4 devices"),
        ({"tensor_map": [-1, 3]}, "does not fit device matrix"),
        ({"dev_matrix": [0]}, "device matrix \\[0\\] is not valid"),
    ],
)
def test_native_strategies_that_cannot_be_imported_exactly_are_refused(
    tmp_path: Path, layout: dict[str, Any], message: str
) -> None:
    for rank in range(2):
        (tmp_path / f"rank_{rank}").mkdir()
        save_file({"w": np.zeros((4, 3), np.float32)}, tmp_path / f"rank_{rank}" / "net.safetensors")
    item = {
        "dev_matrix": [2], "tensor_map": [-1, 0], "field": 0, "opt_weight_shard_step": 0, "opt_weight_shard_size": 0
    }
    (tmp_path / "strategy.json").write_text(json.dumps({"parallel_layout_item": {"w": {**item, **layout}}}))
    with pytest.raises(CheckpointError, match=message):
        import_native(tmp_path, tmp_path / "strategy.json")


def test_a_strategy_file_that_is_not_protobuf_is_refused(tmp_path: Path) -> None:
    (tmp_path / "rank_0").mkdir()
    (tmp_path / "strategy.ckpt").write_bytes(b"\xff" * 64)
    with pytest.raises(CorruptCheckpoint, match="is not a ParallelStrategyMap protobuf"):
        import_native(tmp_path, tmp_path / "strategy.ckpt")


def _within(seconds: float, fifo: Path, work: Callable[[], object]) -> object:
    """`work()` on a thread; fails the test if it is still running after `seconds` (blocked opening `fifo`,
    which is then opened for writing, as often as it takes, so that the thread can end).
    """
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # handed to the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for _ in range(100):
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
            thread.join(0.1)
            if not thread.is_alive():
                break
        pytest.fail(f"reading the checkpoint blocked on the FIFO {fifo} for {seconds} s")
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]


def test_a_fifo_manifest_is_refused_at_once_and_the_loader_falls_back(checkpoints: Path) -> None:
    bad = checkpoints / BAD
    fifo = bad / MANIFEST_NAME
    fifo.unlink()
    os.mkfifo(fifo)
    message = "step_00000020/manifest.json is not a regular file but a FIFO"
    with pytest.raises(CorruptCheckpoint, match=message):
        _within(10, fifo, lambda: verify_checkpoint(bad))
    with pytest.raises(CorruptCheckpoint, match=message):
        _within(10, fifo, lambda: load_checkpoint(bad, 0, 1))
    infos = _within(10, fifo, lambda: list_checkpoints(checkpoints))
    assert [(info.step, info.problem) for info in infos] == [(10, None), (20, message)]  # type: ignore[attr-defined]
    _, manifest = _within(10, fifo, lambda: load_latest(checkpoints, 0, 1))  # type: ignore[misc]
    assert manifest.step == 10


def test_no_directory_on_the_way_to_a_file_is_followed(tmp_path: Path) -> None:
    (tmp_path / "real" / "rank_0").mkdir(parents=True)
    (tmp_path / "real" / "rank_0" / "net.safetensors").write_bytes(b"x")
    (tmp_path / "step_00000001").mkdir()
    (tmp_path / "step_00000001" / "rank_0").symlink_to(tmp_path / "real" / "rank_0")
    with pytest.raises(CorruptCheckpoint, match="^step_00000001/rank_0 is a symbolic link"):
        open_regular_file(tmp_path / "step_00000001", "rank_0/net.safetensors", "step_00000001/rank_0/net.safetensors")
    fd = open_regular_file(tmp_path / "real", "rank_0/net.safetensors", "real/rank_0/net.safetensors")
    try:
        assert os.read(fd, 10) == b"x"
    finally:
        os.close(fd)


def test_retention_removes_a_linked_step_directory_but_not_what_it_links_to(
    checkpoints: Path, other_job: Path
) -> None:
    link = checkpoints / "step_00000005"
    link.symlink_to(other_job, target_is_directory=True)
    assert prune(checkpoints, keep=2, committed_step=20) == [link]
    assert not os.path.lexists(link)
    assert verify_checkpoint(other_job).step == 30


class _NoReports:
    def checkpoint(self, step: int, consumed_samples: int, path: str) -> None:
        raise AssertionError("a refused resume reports nothing")


def _resume(root: Path | None, resume_from: Path) -> CheckpointUnreadable:
    """The error of a resume from `resume_from` with checkpoint directory `root`: it must be refused before
    anything is loaded, so no MindSpore cells are needed.
    """
    ctx = RankContext.from_environ({"TRAINERD_JOB": "unit"})
    settings = RankCheckpointSettings(directory=root, resume_from=resume_from)
    with TrainingCheckpoints(ctx, settings, _NoReports(), (), data_seed=7,  # type: ignore[arg-type]
                             grad_accumulation=2) as checkpoints:
        with pytest.raises(CheckpointUnreadable) as refused:
            checkpoints.resume()
    assert refused.value.exit_code == 65  # EXIT_CHECKPOINT_UNREADABLE: an older checkpoint may still do
    assert "\n" not in str(refused.value)
    return refused.value


@pytest.fixture
def other_job(tmp_path: Path, tensors: dict[str, np.ndarray], save_all: Callable[..., Path]) -> Path:
    """A complete checkpoint of another job, next to this job's checkpoint directory."""
    return save_all(tmp_path / "other", tensors, 1, step=30)


def test_a_resume_from_outside_the_checkpoint_directory_is_refused(checkpoints: Path, other_job: Path) -> None:
    error = _resume(checkpoints, other_job)
    assert str(error) == (f"cannot resume from checkpoint {other_job}: {other_job} is not inside the checkpoint "
                          f"directory {checkpoints}")


def test_a_resume_that_climbs_out_with_dot_dot_is_refused(checkpoints: Path, other_job: Path) -> None:
    climbing = checkpoints / ".." / "other" / other_job.name
    error = _resume(checkpoints, climbing)
    assert str(error) == (f"cannot resume from checkpoint {climbing}: {climbing} is not inside the checkpoint "
                          f"directory {checkpoints} (it resolves to {other_job})")


def test_a_resume_through_a_symbolic_link_out_is_refused(checkpoints: Path, other_job: Path) -> None:
    link = checkpoints / "step_00000030"
    link.symlink_to(other_job, target_is_directory=True)
    error = _resume(checkpoints, link)
    assert str(error) == (f"cannot resume from checkpoint {link}: {link} is not inside the checkpoint "
                          f"directory {checkpoints} (it resolves to {other_job})")


def test_a_resume_through_a_symbolic_link_inside_is_refused_by_the_loader(checkpoints: Path) -> None:
    link = checkpoints / "step_00000030"
    link.symlink_to(checkpoints / GOOD, target_is_directory=True)
    error = _resume(checkpoints, link)
    assert str(error) == f"cannot resume from checkpoint {link}: {link} is a symbolic link " \
                         "(checkpoints are read without following links)"


def test_a_resume_without_a_checkpoint_directory_is_refused(other_job: Path) -> None:
    error = _resume(None, other_job)
    assert str(error) == (f"cannot resume from checkpoint {other_job}: no checkpoint directory "
                          "(TRAINERD_CHECKPOINT_DIR) is set for it to lie in")


def test_the_root_itself_is_not_a_step_directory_inside_it(checkpoints: Path) -> None:
    check_inside_root(checkpoints, checkpoints / GOOD)
    check_inside_root(checkpoints, checkpoints / "sub" / ".." / GOOD)
    with pytest.raises(CheckpointError, match="is not inside the checkpoint directory"):
        check_inside_root(checkpoints, checkpoints / GOOD / "..")
