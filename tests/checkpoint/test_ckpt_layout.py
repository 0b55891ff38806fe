"""The layout model and manifest refuse every layout that would not give back each element exactly once."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest

from trainer.checkpoint import CheckpointError, CheckpointMeta, CorruptCheckpoint, Manifest
from trainer.checkpoint.layout import Chunk, Region, TensorLayout
from trainer.checkpoint.manifest import EpochPosition, FileEntry


def _layout(dtype: str, shape: tuple[int, ...], *boxes: tuple[tuple[int, ...], tuple[int, ...]]) -> TensorLayout:
    chunks = tuple(Chunk(Region(o, s), "rank_0.safetensors", f"k{i}") for i, (o, s) in enumerate(boxes))
    return TensorLayout(dtype, shape, chunks)


def test_a_grid_of_chunks_covering_the_tensor_is_valid() -> None:
    _layout("F32", (4, 6), ((0, 0), (2, 6)), ((2, 0), (2, 3)), ((2, 3), (2, 3))).validate("w")
    _layout("BF16", (), ((), ())).validate("scalar")
    _layout("I64", (0, 5)).validate("empty")


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (_layout("F32", (4, 6), ((0, 0), (4, 7))), "lies outside shape"),
        (_layout("F32", (4, 6), ((0, 0), (3, 6)), ((2, 0), (2, 6))), "chunk 0 overlaps chunk 1"),
        (_layout("F32", (4, 6), ((0, 0), (2, 6)), ((2, 0), (2, 5))), "cover 22 of its 24 elements"),
        (_layout("F32", (4, 6), ((0,), (4,))), "has 1 dimensions, the tensor 2"),
        (_layout("C64", (2,), ((0,), (2,))), "unknown dtype 'C64'"),
        (_layout("F32", (), ((), ()), ((), ())), "overlaps"),
    ],
    ids=["out-of-bounds", "overlap", "gap", "rank-mismatch", "unknown-dtype", "scalar-twice"],
)
def test_invalid_layouts_are_refused_naming_the_tensor(layout: TensorLayout, message: str) -> None:
    with pytest.raises(CorruptCheckpoint, match=message) as info:
        layout.validate("w")
    assert "tensor 'w'" in str(info.value)


def _manifest() -> Manifest:
    return Manifest(
        meta=CheckpointMeta(7, 448, 3, grad_accumulation=4, rng_state={"a": [1]}, skip_ledger=((5, 9),),
                            epoch_position=EpochPosition(1, 3, 4)),
        world_size=2,
        generation=3,
        files=(FileEntry("rank_0.safetensors", 400, "ab"), FileEntry("rank_1.safetensors", 400, "cd")),
        tensors={
            "w": TensorLayout(
                "F32", (10, 8),
                (Chunk(Region((0, 0), (5, 8)), "rank_0.safetensors", "w@0,0", 4, ("0badc0de", "01234567")),
                 Chunk(Region((5, 0), (5, 8)), "rank_1.safetensors", "w@5,0", 8, ("89abcdef",))),
            )
        },
    )


def test_manifest_round_trips_through_json() -> None:
    manifest = _manifest()
    document = manifest.to_json()
    assert document["schema"] == 1 and document["digest_algorithm"] == "crc32+sha256"
    assert Manifest.from_json(copy.deepcopy(document)) == manifest
    del document["epoch_position"]  # a manifest of a step loop, or of a trainerd before it was kept
    assert Manifest.from_json(document).meta.epoch_position is None


def test_an_epoch_position_keeps_its_share_of_the_epoch_at_another_epoch_length() -> None:
    position = EpochPosition(completed=2, steps_done=3, steps_per_epoch=4)
    assert [position.at(n) for n in (4, 2, 8, 21)] == [(2, 3), (2, 1), (2, 6), (2, 15)]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(schema=2), "schema 2 is not supported"),
        (lambda d: d.update(step=-1), "'step' must be an integer"),
        (lambda d: d.update(step=True), "'step' must be an integer"),
        (lambda d: d.pop("consumed_samples"), "'consumed_samples' is missing"),
        (lambda d: d.update(digest_algorithm="md5"), "digest algorithm 'md5' is not supported"),
        (lambda d: d["files"][0].update(name="../rank_0.safetensors"), "not a plain relative path"),
        (lambda d: d["files"][0].update(name="/etc/passwd"), "not a plain relative path"),
        (lambda d: d["files"].append(dict(d["files"][0])), "listed 2 times"),
        (lambda d: d["files"][1].update(size=10), "rank_1.safetensors is 10 bytes but its chunks need 160"),
        (lambda d: d["tensors"]["w"]["chunks"][1].update(file="rank_9.safetensors"), "not listed"),
        (lambda d: d["tensors"]["w"]["chunks"][1].update(key="w@0,0", file="rank_0.safetensors"), "used twice"),
        (lambda d: d["tensors"]["w"].update(shape=[1 << 60, 8]), "must be an integer from 0"),
        (lambda d: d["tensors"]["w"].update(shape=[1] * 40), "more than 32"),
        (lambda d: d["tensors"]["w"]["chunks"][0].update(offsets=[-5, 0]), "must be an integer from 0"),
        (lambda d: d.update(skip_ledger=[[9, 5]]), "skip_ledger entry 0"),
        (lambda d: d.update(epoch_position=[1, 4, 4]), "steps_done must be an integer from 0 to 3"),
        (lambda d: d.update(epoch_position=[1, 0, 0]), "steps_per_epoch must be an integer from 1"),
        (lambda d: d.update(epoch_position=[1, 2]), r"epoch_position must be \[completed, steps_done"),
        (lambda d: d["tensors"]["w"]["chunks"][0].update(segment_rows=1), "lists 2 checksums for 5 segments"),
        (lambda d: d["tensors"]["w"]["chunks"][0]["checksums"].append("zz"), "must be CRC-32s of 8 hexadecimal digits"),
    ],
)
def test_hostile_manifest_fields_are_refused_with_a_clear_error(edit: Callable[[dict], object], message: str) -> None:
    document = _manifest().to_json()
    edit(document)
    with pytest.raises(CorruptCheckpoint, match=message):
        Manifest.from_json(document)


def test_meta_that_a_manifest_cannot_hold_is_refused_before_saving() -> None:
    with pytest.raises(CheckpointError, match="cannot be saved"):
        CheckpointMeta(1, 0, 0, rng_state=object()).check()
    with pytest.raises(CheckpointError, match="cannot be saved"):
        CheckpointMeta(-1, 0, 0).check()
