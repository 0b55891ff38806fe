"""A Model.train script's dataset, read through trainerd's sample stream: exact data resume at any world size.

    dataset = ds.GeneratorDataset(source, ["x", "y"], ...)       # the script's own; its sampling is replaced
    dataset = trainerd_dataset(dataset, batch_size, steps_per_epoch)
    model.train(epochs, dataset, callbacks=[TrainerdCallback(), ...], initial_epoch=resume_epoch(dataset))

Every step reads the next global batch of the seeded stream (`trainer.data.sampler`), leaving out the skip
ledger's ranges, and this rank its block of it (`EpochSampler`); a run that trainerd resumes from a
checkpoint (TRAINERD_RESUME_FROM) starts at that checkpoint's stream position, inside its epoch, whatever
world size wrote it. Model.train must be told the epoch (`initial_epoch=resume_epoch(dataset)`); the
steps of that epoch already trained are skipped by the dataset (`set_init_step`) without being read.

The batch: a dataset row is one rank's share of a step, `micro_batch × grad_accum` samples, which
`GuardedTrainOneStepCell` splits into `grad_accum` micro batches. Under trainerd the launch decides
(TRAINERD_GLOBAL_BATCH, TRAINERD_MICRO_BATCH, TRAINERD_GRAD_ACCUM: the global batch stays the same at every
world size) and `batch_size` must equal its micro batch; without that split, or run by hand or by msrun,
`batch_size` samples per rank and step.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import mindspore.dataset as ds

from trainer.data.mindspore_sampler import EpochSampler
from trainer.data.sampler import SampleStream
from trainer.data.skip_ranges import SkipRanges
from trainer.runtime.checkpointing import ResumeError, ResumePoint, resume_point
from trainer.runtime.rank_context import BatchSettings, RankContext, trainerd_launch

SKIPS_FILE_ENV = "TRAINERD_SKIPS_FILE"


def trainerd_dataset(dataset: ds.GeneratorDataset, batch_size: int, steps_per_epoch: int | None = None, *,
                     seed: int = 0, environ: Mapping[str, str] | None = None) -> ds.Dataset:
    """`dataset`'s source read through the sample stream of `seed`, batched by step: each row is this rank's
    share of one step. `steps_per_epoch` defaults to one pass over the source (its length // global batch).

    Takes the GeneratorDataset itself (not `.batch(...)` of it), with a random-access source; its column
    names and worker settings are kept, its shuffling, sharding and sampler replaced. Call it after
    `mindspore.communication.init()`. Under trainerd, a checkpoint that cannot be resumed ends the process
    with the status the coordinator expects (65 unreadable, 2 another seed); a bad argument raises ValueError.
    """
    env = os.environ if environ is None else environ
    ctx = trainerd_launch(env)
    source = _random_access_source(dataset)
    rank, world_size = _communication_rank(ctx)
    batch = _batch_split(ctx, batch_size, world_size)
    skips = env.get(SKIPS_FILE_ENV)
    stream = SampleStream(len(source), seed, SkipRanges.read(skips) if skips else SkipRanges())
    if steps_per_epoch is None:
        steps_per_epoch = len(source) // batch.global_batch
        if steps_per_epoch < 1:
            raise ValueError(f"the source's {len(source)} samples are less than one global batch of "
                             f"{batch.global_batch}: give steps_per_epoch")
    start = _resume_point(ctx, seed) if ctx is not None else ResumePoint(0, 0)
    sampler = EpochSampler(stream, batch.global_batch, rank, world_size, steps_per_epoch,
                           first_step=start.step, first_consumed=start.consumed_samples,
                           first_epoch_position=start.epoch_position)
    columns = {"column_names": dataset.column_names} if dataset.schema is None else {"schema": dataset.schema}
    elastic = ds.GeneratorDataset(
        source, **columns, sampler=sampler, num_parallel_workers=dataset.num_parallel_workers,
        python_multiprocessing=dataset.python_multiprocessing,
        max_rowsize=None if dataset.max_rowsize == -1 else dataset.max_rowsize,
    ).batch(batch.per_rank, drop_remainder=True)
    elastic.set_init_step(sampler.skipped_steps)
    return elastic


def resume_epoch(dataset: ds.Dataset) -> int:
    """The `initial_epoch` to pass Model.train for `dataset` (built by `trainerd_dataset`): 0 for a fresh
    run, else the epochs the resumed checkpoint has completed."""
    sampler = find_epoch_sampler(dataset)
    if sampler is None:
        raise ValueError("the dataset was not built by trainerd_dataset, so it does not know where training resumes")
    return sampler.first_epoch - 1


def find_epoch_sampler(dataset: ds.Dataset) -> EpochSampler | None:
    """The EpochSampler `trainerd_dataset` put into `dataset`'s pipeline, None when there is none."""
    pending = [dataset]
    while pending:
        node = pending.pop()
        sampler = getattr(node, "sampler", None)
        if isinstance(sampler, EpochSampler):
            return sampler
        pending.extend(node.children)
    return None


def _random_access_source(dataset: ds.GeneratorDataset) -> Any:
    if not isinstance(dataset, ds.GeneratorDataset):
        raise ValueError(f"trainerd_dataset takes a GeneratorDataset (before .batch), not a {type(dataset).__name__}")
    source = dataset.source
    if not (hasattr(source, "__getitem__") and hasattr(source, "__len__")):
        raise ValueError("trainerd_dataset needs a random-access source (__getitem__ and __len__), "
                         f"not a {type(source).__name__}")
    if dataset.column_types or dataset.has_batch_sampler or dataset.collate_fn is not None:
        raise ValueError("trainerd_dataset does not take a GeneratorDataset with column_types, batch_sampler "
                         "or collate_fn")
    return source


def _communication_rank(ctx: RankContext | None) -> tuple[int, int]:
    """This process's rank and the world size as MindSpore's communication sees them ((0, 1) when it is not
    initialised), checked against trainerd's launch."""
    from mindspore.communication.management import GlobalComm, get_group_size, get_rank

    rank, world_size = (get_rank(), get_group_size()) if GlobalComm.INITED else (0, 1)
    if ctx is not None and (rank, world_size) != (ctx.rank, ctx.world_size):
        raise ValueError(f"trainerd launched this process as rank {ctx.rank} of {ctx.world_size}, but MindSpore's "
                         f"communication says rank {rank} of {world_size}: call init() before trainerd_dataset")
    return rank, world_size


def _batch_split(ctx: RankContext | None, batch_size: int, world_size: int) -> BatchSettings:
    """The launch's split (its micro batch must be `batch_size`), else `batch_size` per rank and step."""
    if ctx is not None and ctx.batch is not None:
        if batch_size != ctx.batch.micro_batch:
            raise ValueError(f"batch_size {batch_size} disagrees with the launch's micro batch "
                             f"{ctx.batch.micro_batch} (TRAINERD_MICRO_BATCH)")
        return ctx.batch
    return BatchSettings.for_world(batch_size * world_size, batch_size, world_size)


def _resume_point(ctx: RankContext, seed: int) -> ResumePoint:
    """Where TRAINERD_RESUME_FROM stands, from its manifest (TrainerdCallback loads and verifies the tensors
    when training begins); exits as the coordinator expects when the checkpoint cannot be used."""
    try:
        return resume_point(ctx.checkpoints, seed) or ResumePoint(0, 0)
    except ResumeError as exc:
        print(f"trainerd_dataset: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from exc
