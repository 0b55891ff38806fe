"""The copy into a save's host buffers, split over threads, copies every byte of every kind of source: a
tensor many parts long, the non-contiguous region of a tensor sharded past its first dimension, one row
longer than a part, a scalar, and the small ones; and a save returns only once all of it is copied.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from trainer.checkpoint import CheckpointMeta, CheckpointWriter, load_checkpoint
from trainer.checkpoint.parallel_copy import PART_BYTES, ParallelCopier


def _sources(rng: np.random.Generator) -> list[np.ndarray]:
    wide = rng.standard_normal((1536, 4100), dtype=np.float32)  # 25 MB: two parts and a remainder
    return [
        rng.standard_normal(PART_BYTES // 4 * 3 + 7, dtype=np.float32),  # contiguous, cut flat
        wide[:, 1000:3999],                                          # a dim-1 shard: cut by rows
        rng.standard_normal((1, PART_BYTES // 2 + 10)).astype(np.float32)[:, ::2],  # one strided row past a part
        np.array(3.5, dtype=np.float64),                             # 0-d
        rng.integers(0, 255, 1000, dtype=np.uint8),                  # small
        np.empty((0, 8), dtype=np.float16),                          # empty
    ]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_byte_of_every_kind_of_source_is_copied(threads: int) -> None:
    sources = _sources(np.random.default_rng(threads))
    targets = [np.zeros(source.shape, source.dtype) for source in sources]
    copier = ParallelCopier(threads)
    try:
        copier.copy(list(zip(targets, sources, strict=True)))
    finally:
        copier.close()
    for target, source in zip(targets, sources, strict=True):
        assert target.tobytes() == np.ascontiguousarray(source).tobytes()


def test_a_copy_that_cannot_be_made_raises_and_the_copier_goes_on() -> None:
    copier = ParallelCopier(2)
    try:
        big = np.ones(PART_BYTES, dtype=np.uint8)
        with pytest.raises(ValueError):
            copier.copy([(np.zeros(PART_BYTES * 2, np.uint8), np.ones(PART_BYTES * 2, np.uint8)),
                         (np.zeros(3, np.uint8), big)])  # shapes that do not broadcast
        target = np.zeros(PART_BYTES * 3, np.uint8)
        copier.copy([(target, np.full(PART_BYTES * 3, 7, np.uint8))])
        assert (target == 7).all()
    finally:
        copier.close()


def test_a_save_of_tensors_many_parts_long_returns_only_once_they_are_copied(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tensors = {"big": rng.standard_normal(PART_BYTES // 4 * 5, dtype=np.float32),
                "wide": rng.standard_normal((2048, 2500), dtype=np.float32)}
    expected = {name: array.copy() for name, array in tensors.items()}
    with CheckpointWriter(tmp_path, 0, 1, copy_threads=2) as writer:
        writer.save_async(CheckpointMeta(1, 0, 0), tensors)
        for array in tensors.values():
            array[...] = 0  # the next step overwrites the parameters in place
        writer.wait()
    loaded = load_checkpoint(tmp_path / "step_00000001", 0, 1)[0]
    for name, array in expected.items():
        assert loaded[name].tobytes() == array.tobytes()
