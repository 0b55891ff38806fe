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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import mindspore.dataset as ds
import numpy as np

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
