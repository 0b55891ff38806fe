"""In-memory snapshot files as the workers of a generation spanning hosts leave them (scope host): each rank's
data file and report, written by the real checkpoint writer."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from agent.snapshots.memory_snapshots import step_dir_name
from trainer.checkpoint import CheckpointMeta, CheckpointWriter

TENSORS = {
    "embed": np.random.default_rng(5).standard_normal((37, 16)).astype(np.float32),
    "fc.weight": np.random.default_rng(6).standard_normal((23, 9)).astype(np.float16),
    "fc.bias": np.arange(9, dtype=np.int64),
    "step": np.array(41, dtype=np.int32),
}


def host_snapshot(job_dir: Path, step: int, ranks: tuple[int, ...], world_size: int = 4, generation: int = 3,
                  tensors: dict[str, np.ndarray] = TENSORS) -> Path:
    """What the workers of `ranks` leave in scope host: each rank's file and report (real writer)."""
    for rank in ranks:
        meta = CheckpointMeta(step=step, consumed_samples=8 * step, data_seed=1, skip_ledger=((8, 16),))
        with CheckpointWriter(job_dir, rank, world_size, generation=generation, commit=False) as writer:
            writer.save(meta, tensors)
    return job_dir / step_dir_name(step)
