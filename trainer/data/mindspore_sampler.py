"""The sample stream as MindSpore datasets read it: this rank's dataset indices, step after step, from a
resume point on. Batch the dataset by micro_batch and each step's grad_accum micro batches come out in order.

    stream = SampleStream(dataset_size, seed, skips)
    # a Python source (random access: __getitem__ and __len__)
    data = GeneratorDataset(source, column_names, sampler=ElasticSampler(stream, consumed, global_batch,
                            rank, world_size, steps)).batch(micro_batch)
    # a MindRecord file
    data = elastic_mind_dataset(files, stream, consumed, global_batch, rank, world_size, steps).batch(micro_batch)

What MindSpore 2.10 accepts, found by trying: GeneratorDataset takes any `mindspore.dataset.Sampler`
subclass and reads as many indices as it yields (its built-in SubsetSampler instead refuses to read more
than len(source), i.e. more than one epoch). MindDataset takes only its built-in samplers; of those only
SubsetSampler follows a given order, and it refuses more indices than the file has records (and crashes
the process on an empty list). So `elastic_mind_dataset` concatenates MindDatasets over windows of at
most one file's worth of indices each.

Both build the whole window's indices up front (steps × global_batch / world_size of them, 8 bytes
each, as MindSpore itself materialises a sampler's indices): for a very long run, build the dataset for a
few thousand steps at a time from the consumed count the previous one ended at (`next_consumed`).

`Model.train` reads its dataset once per epoch, and a GeneratorDataset asks its sampler for a new pass
each time, each pass being exactly `num_samples` indices (MindSpore refuses a shorter one). `EpochSampler`
makes pass k the next epoch of the stream, so an epoch is `steps_per_epoch` steps whatever the world size.
MindSpore works on a deep copy of the sampler for every iterator it builds (also for probes like
`output_shapes()`), so each iterator starts again at the first pass and the object passed in never moves.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import mindspore.dataset as ds
import numpy as np

from trainer.checkpoint.manifest import EpochPosition
from trainer.data.sampler import SampleStream


class ElasticSampler(ds.Sampler):
    """For `GeneratorDataset(source, ..., sampler=ElasticSampler(...))`: rank `rank`'s dataset indices for
    `steps` steps (at least 1) starting at stream position `consumed_samples`, in reading order.
    `next_consumed` is the stream position after the last of those steps.
    """

    def __init__(self, stream: SampleStream, consumed_samples: int, global_batch: int, rank: int,
                 world_size: int, steps: int) -> None:
        self.schedule, self.next_consumed = _schedule(stream, consumed_samples, global_batch, rank, world_size,
                                                      steps)
        super().__init__(num_samples=self.schedule.size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.schedule.ravel().tolist())

    def __len__(self) -> int:
        return self.schedule.size


class EpochSampler(ds.Sampler):
    """For `Model.train` over `GeneratorDataset(source, ..., sampler=EpochSampler(...)).batch(global_batch //
    world_size)`: each pass yields rank `rank`'s dataset indices for the next `steps_per_epoch` steps, so
    epoch e (counting from 1) trains steps (e - 1) × steps_per_epoch + 1 to e × steps_per_epoch.

    A run resuming after step `first_step` (stream position `first_consumed`) starts in epoch
    `first_step // steps_per_epoch + 1` (pass `initial_epoch=first_epoch - 1` to Model.train). Its first pass
    begins with `first_step % steps_per_epoch` placeholder steps, the epoch's steps already trained, and the
    dataset must skip them (`dataset.set_init_step(skipped_steps)`: MindSpore then reads no sample for them).
    With `first_epoch_position` (the checkpoint's place in the epochs of the run that saved it) the epoch and
    the share of it trained come from there instead: a world size without a fixed global batch changes the
    steps per epoch, and the steps trained at the old length say nothing about the new epochs.
    """

    def __init__(self, stream: SampleStream, global_batch: int, rank: int, world_size: int, steps_per_epoch: int,
                 first_step: int = 0, first_consumed: int = 0,
                 first_epoch_position: EpochPosition | None = None) -> None:
        if steps_per_epoch < 1:
            raise ValueError(f"an epoch needs at least one step, not {steps_per_epoch}")
        if first_step < 0 or first_consumed < 0:
            raise ValueError(f"cannot start after step {first_step} at stream position {first_consumed}")
        # No steps: only checks the split and the position, here rather than in MindSpore's pipeline thread.
        self.per_rank = stream.rank_indices(first_consumed, global_batch, rank, world_size, 0)[0].shape[1]
        self.stream = stream
        self.global_batch = global_batch
        self.rank = rank
        self.world_size = world_size
        self.steps_per_epoch = steps_per_epoch
        self.first_step = first_step
        self.first_consumed = first_consumed
        self._epochs_completed, self.skipped_steps = (
            divmod(first_step, steps_per_epoch) if first_epoch_position is None
            else first_epoch_position.at(steps_per_epoch))
        self._placeholder_steps = self.skipped_steps
        self._consumed = first_consumed
        super().__init__(num_samples=steps_per_epoch * self.per_rank)

    @property
    def first_epoch(self) -> int:
        """The epoch (counting from 1) the first pass belongs to. (`skipped_steps`: the placeholder steps at the
        start of the first pass, to `dataset.set_init_step`.)"""
        return self._epochs_completed + 1

    def __iter__(self) -> Iterator[int]:
        placeholders, self._placeholder_steps = self._placeholder_steps, 0
        schedule, self._consumed = self.stream.rank_indices(self._consumed, self.global_batch, self.rank,
                                                            self.world_size, self.steps_per_epoch - placeholders)
        # Index 0 exists in every dataset; MindSpore skips these without reading them.
        return iter([0] * (placeholders * self.per_rank) + schedule.ravel().tolist())

    def __len__(self) -> int:
        return self.steps_per_epoch * self.per_rank


def elastic_mind_dataset(dataset_files: str | Sequence[str], stream: SampleStream, consumed_samples: int,
                         global_batch: int, rank: int, world_size: int, steps: int,
                         columns_list: Sequence[str] | None = None) -> ds.Dataset:
    """A MindRecord dataset that yields rank `rank`'s samples for `steps` steps (at least 1) from stream
    position `consumed_samples` on, in reading order. The file must hold `stream.dataset_size` records.
    """
    schedule, _ = _schedule(stream, consumed_samples, global_batch, rank, world_size, steps)
    flat = schedule.ravel()
    parts = [
        ds.MindDataset(dataset_files, columns_list=list(columns_list) if columns_list else None,
                       sampler=ds.SubsetSampler(flat[start:start + stream.dataset_size].tolist()))
        for start in range(0, flat.size, stream.dataset_size)
    ]
    return parts[0] if len(parts) == 1 else ds.ConcatDataset(parts)


def _schedule(stream: SampleStream, consumed_samples: int, global_batch: int, rank: int, world_size: int,
              steps: int) -> tuple[np.ndarray, int]:
    if steps < 1:
        raise ValueError(f"a sampler needs at least one step, not {steps}")
    return stream.rank_indices(consumed_samples, global_batch, rank, world_size, steps)
