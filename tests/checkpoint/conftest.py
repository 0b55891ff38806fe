"""Fixtures for the checkpoint tests: a model's worth of tensors and a job of N ranks that saves them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pytest

from trainer.checkpoint import CheckpointMeta, CheckpointWriter

SaveAll = Callable[..., Path]


@pytest.fixture
def tensors() -> dict[str, np.ndarray]:
    """Tensors of every shape class: large (split across ranks), odd-sized, scalar, empty, integer, bool."""
    rng = np.random.default_rng(1234)
    return {
        "embed.weight": rng.standard_normal((517, 2048)).astype(np.float32),
        "fc1.weight": rng.standard_normal((1031, 1000)).astype(np.float32),
        "fc1.bias": rng.standard_normal(300).astype(np.float32),
        "half": rng.standard_normal((33, 7, 5)).astype(np.float16),
        "moment1.fc1.weight": rng.standard_normal((1031, 300)),
        "global_step": np.array(41, dtype=np.int32),
        "counts": rng.integers(0, 1 << 40, size=(9, 2), dtype=np.int64),
        "mask": rng.integers(0, 2, size=64).astype(bool),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }


def _meta_for(step: int) -> CheckpointMeta:
    return CheckpointMeta(
        step=step,
        consumed_samples=step * 64,
        data_seed=7,
        grad_accumulation=2,
        rng_state={"numpy": [1, 2, 3], "mindspore": "seed=7"},
        skip_ledger=((128, 192),),
    )


@pytest.fixture
def meta_for() -> Callable[[int], CheckpointMeta]:
    """The training position every test saves at `step`."""
    return _meta_for


@pytest.fixture
def save_all() -> SaveAll:
    """Saves `tensors` at `step` as a job of `world_size` ranks would: one writer per rank, all in flight
    at once, rank 0 committing. Returns the step directory.
    """

    def run(
        root: Path, tensors: Mapping[str, np.ndarray], world_size: int, step: int = 100, generation: int = 0
    ) -> Path:
        writers = [
            CheckpointWriter(root, rank, world_size, generation=generation, commit_timeout_s=30)
            for rank in range(world_size)
        ]
        try:
            for writer in writers:
                writer.save_async(_meta_for(step), tensors)
            results = [writer.wait() for writer in writers]
        finally:
            for writer in writers:
                writer.close()
        return results[0]

    return run
