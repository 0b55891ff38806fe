"""Which samples each optimizer step reads, on every rank, at any world size, from any resume point.

The job reads one endless stream of sample *positions* 0, 1, 2, ...; position p belongs to epoch
p // dataset_size and reads dataset index permutation(seed, epoch)[p % dataset_size], the permutation
being `numpy.random.default_rng([seed, epoch]).permutation(dataset_size)`. The stream depends on the
seed alone, never on the world size, so a job resumed at another size continues exactly where its
checkpoint stopped.

- Each optimizer step consumes one global batch: the next `global_batch` positions from
  `consumed_samples` on that the skip ledger does not leave out. Ledger positions passed over count as
  consumed, so the step's `next_consumed` is always the position after its last sample.
- Rank r of W takes the r-th contiguous block of global_batch / W positions, and reads it as
  grad_accum micro batches of micro_batch samples in order (`rank_share`).
- A resume constructs the stream and asks for the step at the checkpoint's consumed_samples:
  O(ledger + batch) work, nothing earlier is read or replayed.

Pure numpy; `trainer.data.mindspore_sampler` hands the same indices to a MindSpore dataset.
"""

from __future__ import annotations

import bisect
import numbers
from collections.abc import Iterable
from typing import Any

import numpy as np

from trainer.data.skip_ranges import SkipRanges

_CACHED_EPOCHS = 2  # a step straddles at most two epochs unless the batch is larger than the dataset


class SampleStream:
    """The job's sample order for one dataset size, seed and skip ledger."""

    def __init__(self, dataset_size: int, seed: int, skips: SkipRanges | Iterable[Any] = ()) -> None:
        _check_int("dataset_size", dataset_size, minimum=1)
        _check_int("seed", seed, minimum=0)
        self.dataset_size = int(dataset_size)
        self.seed = int(seed)
        self.ledger = skips if isinstance(skips, SkipRanges) else SkipRanges.of(skips)
        self._ends = [end for _, end in self.ledger.ranges]
        self._permutations: dict[int, np.ndarray] = {}

    def step_positions(self, consumed_samples: int, global_batch: int) -> tuple[np.ndarray, int]:
        """The positions of the step that starts at `consumed_samples` (ascending int64, `global_batch` of
        them, none in the ledger) and the consumed count after it (its last position + 1).

        The step's global sample range, as a bad-batch report names it, is [positions[0], next_consumed).
        """
        _check_int("consumed_samples", consumed_samples, minimum=0)
        _check_int("global_batch", global_batch, minimum=1)
        ranges = self.ledger.ranges
        positions = np.empty(global_batch, dtype=np.int64)
        position, filled = int(consumed_samples), 0
        i = bisect.bisect_right(self._ends, position)  # the first range that ends after `position`
        while filled < global_batch:
            if i < len(ranges) and ranges[i][0] <= position:
                position = ranges[i][1]  # inside a skipped range: jump past it
                i += 1
                continue
            stop = ranges[i][0] if i < len(ranges) else position + global_batch
            take = min(global_batch - filled, stop - position)
            positions[filled:filled + take] = np.arange(position, position + take, dtype=np.int64)
            filled += take
            position += take
        return positions, position

    def indices(self, positions: np.ndarray) -> np.ndarray:
        """The dataset indices (int64) that stream positions read; any shape, kept."""
        positions = np.asarray(positions, dtype=np.int64)
        epochs = positions // self.dataset_size
        result = np.empty_like(positions)
        for epoch in np.unique(epochs):
            in_epoch = epochs == epoch
            result[in_epoch] = self.permutation(int(epoch))[positions[in_epoch] % self.dataset_size]
        return result

    def permutation(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s order of dataset indices (the last two epochs asked for are cached)."""
        order = self._permutations.get(epoch)
        if order is None:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size)
            if len(self._permutations) >= _CACHED_EPOCHS:
                self._permutations.pop(next(iter(self._permutations)))
            self._permutations[epoch] = order
        return order

    def rank_indices(self, consumed_samples: int, global_batch: int, rank: int, world_size: int,
                     steps: int) -> tuple[np.ndarray, int]:
        """The dataset indices one rank reads in the next `steps` steps from `consumed_samples`, shaped
        (steps, global_batch // world_size) in reading order, and the consumed count after the last step.
        """
        _check_int("steps", steps, minimum=0)
        out = np.empty((steps, _per_rank(global_batch, rank, world_size)), dtype=np.int64)
        consumed = consumed_samples
        for step in range(steps):
            positions, consumed = self.step_positions(consumed, global_batch)
            out[step] = self.indices(rank_share(positions, rank, world_size, out.shape[1]).ravel())
        return out, consumed


def rank_share(step_batch: np.ndarray, rank: int, world_size: int, micro_batch: int) -> np.ndarray:
    """Rank `rank`'s contiguous block of one step's global batch (positions or indices), shaped
    (grad_accum, micro_batch): rank r takes items [r × per_rank, (r + 1) × per_rank), per_rank =
    len(step_batch) / world_size, and reads them as consecutive micro batches.
    """
    per_rank = _per_rank(len(step_batch), rank, world_size)
    _check_int("micro_batch", micro_batch, minimum=1)
    if per_rank % micro_batch:
        raise ValueError(f"a rank's {per_rank} samples per step do not split into micro batches of {micro_batch}")
    return np.asarray(step_batch)[rank * per_rank:(rank + 1) * per_rank].reshape(-1, micro_batch)


def _per_rank(global_batch: int, rank: int, world_size: int) -> int:
    _check_int("world_size", world_size, minimum=1)
    _check_int("rank", rank, minimum=0)
    if rank >= world_size:
        raise ValueError(f"rank {rank} is not below the world size {world_size}")
    if global_batch % world_size:
        raise ValueError(f"the global batch of {global_batch} does not split over {world_size} ranks")
    return global_batch // world_size


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, not {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, not {value}")
