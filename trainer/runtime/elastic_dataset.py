"""A Model.train script's dataset, read through trainerd's sample stream: exact data resume at any world size.

    dataset = ds.MnistDataset(path, ...).map(transforms, "image")  # the script's own; its sampling is replaced
    dataset = trainerd_dataset(dataset, batch_size, steps_per_epoch)   # instead of .batch(batch_size)
    model.train(epochs, dataset, callbacks=[TrainerdCallback(), ...], initial_epoch=resume_epoch(dataset))

The dataset is any pipeline that reads by index: a source MindSpore can give a sampler (a GeneratorDataset
over a random-access source, MnistDataset, ImageFolderDataset, NumpySlicesDataset, ...),
followed only by steps that keep one row per sample in the source's order (`.map`, `.project`, `.rename`).
The source's sampler (its shuffle, `num_shards`/`shard_id` and sampler) is replaced, on a copy: the dataset
passed in is left as it was. What cannot follow the stream is refused with a ValueError that says what to
change: `.batch`, `.shuffle` or `.repeat` already applied, a source read in file order (TFRecordDataset,
CSVDataset, ...), and MindDataset, which takes only MindSpore's built-in samplers.

Every step reads the next global batch of the seeded stream (`trainer.data.sampler`), leaving out the skip
ledger's ranges, and this rank its block of it (`EpochSampler`); a run that trainerd resumes from a
checkpoint (TRAINERD_RESUME_FROM) starts at that checkpoint's stream position, inside its epoch, whatever
world size wrote it. Model.train must be told the epoch (`initial_epoch=resume_epoch(dataset)`); the
steps of that epoch already trained are skipped by the dataset (`set_init_step`) without being read. A
`.map` with random augmentations draws other random numbers after a resume than the run would have without
it (MindSpore skips the trained steps below the map); deterministic transforms resume bit-identical.

The batch: a dataset row is one rank's share of a step, `micro_batch × grad_accum` samples, which
`GuardedTrainOneStepCell` splits into `grad_accum` micro batches. Under trainerd the launch decides
(TRAINERD_GLOBAL_BATCH, TRAINERD_MICRO_BATCH, TRAINERD_GRAD_ACCUM: the global batch stays the same at every
world size) and `batch_size` must equal its micro batch; without that split, or run by hand or by msrun,
`batch_size` samples per rank and step.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Mapping

import mindspore.dataset as ds

from proto.launch_env import MICRO_BATCH_ENV, SKIPS_FILE_ENV
from trainer.checkpoint.manifest import EpochPosition
from trainer.data.mindspore_sampler import EpochSampler
from trainer.data.sampler import SampleStream
from trainer.data.skip_ranges import SkipRanges
from trainer.runtime.checkpointing import ResumeError, ResumePosition, resume_position
from trainer.runtime.epoch_agreement import RESUME_EPOCH_MARK
from trainer.runtime.rank_context import BatchSettings, RankContext, trainerd_launch

# The data seed the checkpoints of a run on a dataset of the script's own keep: trainerd's stream orders
# nothing there, its positions only count samples.
OWN_DATASET_SEED = 0


def trainerd_dataset(dataset: ds.Dataset, batch_size: int, steps_per_epoch: int | None = None, *,
                     seed: int = 0, environ: Mapping[str, str] | None = None) -> ds.Dataset:
    """`dataset` read through the sample stream of `seed`, batched by step: each row is this rank's share of
    one step. `steps_per_epoch` defaults to one pass over the source (its samples // global batch).

    Takes the dataset before `.batch(...)`: a source that reads by index, with only `.map`, `.project` or
    `.rename` after it (the module's docstring). Call it after `mindspore.communication.init()`. Under
    trainerd, a checkpoint that cannot be resumed ends the process with the status the coordinator expects
    (65 unreadable, 2 another seed); a dataset it cannot read this way, or a bad argument, raises ValueError.
    """
    env = os.environ if environ is None else environ
    ctx = trainerd_launch(env)
    dataset = copy.deepcopy(dataset)
    source = _indexed_source(dataset)
    samples = _sample_count(source)
    rank, world_size = _communication_rank(ctx)
    batch = _batch_split(ctx, batch_size, world_size)
    skips = env.get(SKIPS_FILE_ENV)
    stream = SampleStream(samples, seed, SkipRanges.read(skips) if skips else SkipRanges())
    if steps_per_epoch is None:
        steps_per_epoch = samples // batch.global_batch
        if steps_per_epoch < 1:
            raise ValueError(f"the source's {samples} samples are less than one global batch of "
                             f"{batch.global_batch}: give steps_per_epoch")
    start = _resume_position(ctx, seed) if ctx is not None else ResumePosition(0, 0)
    sampler = EpochSampler(stream, batch.global_batch, rank, world_size, steps_per_epoch,
                           first_step=start.step, first_consumed=start.consumed_samples,
                           first_epoch_position=start.epoch_position)
    source.use_sampler(sampler)
    elastic = dataset.batch(batch.per_rank, drop_remainder=True)
    elastic.set_init_step(sampler.skipped_steps)
    return elastic


def resume_epoch(dataset: ds.Dataset, *, environ: Mapping[str, str] | None = None) -> int:
    """The `initial_epoch` to pass Model.train for `dataset`: 0 for a fresh run (or outside trainerd), else the
    epochs the resumed checkpoint has completed.

    A dataset `trainerd_dataset` built knows it. A dataset of the script's own (batched already: a
    `MindDataset`, a `TFRecordDataset`, any pipeline) is positioned here, before Model.train reads it, at
    the step of that epoch the checkpoint reached (`set_init_step`, as MindSpore's and MindFormers' own
    resumes do), counted in its epochs of `get_dataset_size()` steps: the run then trains the steps and
    epochs it asked for, and the finished ones not again. Which samples those steps read is the dataset's
    own affair: the same ones as without the fault only where its order is (a seeded or no shuffle, the
    same sharding).

    It marks `dataset` as asked about (`epoch_agreement.RESUME_EPOCH_MARK`): TrainerdCallback refuses at the
    first start a Model.train of several epochs over a dataset of the script's own without that mark, which
    could not resume after its first epoch.
    """
    sampler = find_epoch_sampler(dataset)
    if sampler is not None:
        epoch = sampler.first_epoch - 1
    else:
        ctx = trainerd_launch(os.environ if environ is None else environ)
        if ctx is None or ctx.is_scheduler:
            epoch = 0
        else:
            position = own_dataset_position(dataset, _resume_position(ctx, OWN_DATASET_SEED, "resume_epoch"))
            dataset.set_init_step(position.steps_done)
            epoch = position.completed
    setattr(dataset, RESUME_EPOCH_MARK, epoch)
    return epoch


def positioned_for_resume(dataset: ds.Dataset) -> bool:
    """Whether a resume finds `dataset` at the checkpoint's place in its epoch: trainerd_dataset built it, or
    resume_epoch was asked about it."""
    return hasattr(dataset, RESUME_EPOCH_MARK) or find_epoch_sampler(dataset) is not None


def own_dataset_position(dataset: ds.Dataset, start: ResumePosition) -> EpochPosition:
    """Where `start` stands in the epochs of `dataset`, a dataset of the script's own (an epoch is its
    `get_dataset_size()` steps): the checkpoint's place in its epochs, the same share of an epoch when their
    length changed with the world size; from the step alone for a checkpoint that has no place. Raises
    ValueError when the dataset cannot say how many steps an epoch has."""
    size = dataset.get_dataset_size()
    if size is None or size < 1:
        raise ValueError(f"the dataset's size is unknown ({size}), and with it how many steps an epoch has: give "
                         "it a size (a GeneratorDataset's source with __len__), or build it with trainerd_dataset")
    steps_per_epoch = int(size)
    if start.epoch_position is not None:
        return EpochPosition(*start.epoch_position.at(steps_per_epoch), steps_per_epoch)
    return EpochPosition(*divmod(start.step, steps_per_epoch), steps_per_epoch)


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


# Pipeline steps that keep one row per sample, in the order the source reads them.
_ROW_STEPS = (ds.MapDataset, ds.ProjectDataset, ds.RenameDataset)
_TOO_LATE = {
    ds.BatchDataset: "call trainerd_dataset before .batch(...): it batches by step itself",
    ds.ShuffleDataset: "drop .shuffle(...): trainerd_dataset orders the samples itself (seeded, the same order "
                       "at every world size)",
    ds.RepeatDataset: "drop .repeat(...): Model.train's epochs repeat the dataset",
}
_OWN_DATASET = ("batch the dataset yourself and leave trainerd_dataset out: resume_epoch(dataset) then resumes "
                "it by step")
_INDEXED = ("a GeneratorDataset over a random-access source, or a MindSpore dataset that takes a sampler "
            "(MnistDataset, ImageFolderDataset, NumpySlicesDataset, ...), with only .map, .project or .rename "
            "after it")


def _indexed_source(dataset: ds.Dataset) -> ds.MappableDataset:
    """The source under `dataset`'s row steps, one whose sampler trainerd can replace."""
    node = dataset
    while isinstance(node, _ROW_STEPS):
        node = node.children[0]
    name = type(node).__name__
    for step, advice in _TOO_LATE.items():
        if isinstance(node, step):
            raise ValueError(f"trainerd_dataset got a {name}: {advice}")
    if isinstance(node, ds.MindDataset):
        raise ValueError("trainerd_dataset cannot read a MindDataset: it takes only MindSpore's built-in samplers, "
                         "which cannot follow trainerd's sample stream from epoch to epoch; give it a "
                         f"GeneratorDataset whose source reads the records by index, or {_OWN_DATASET}")
    if not isinstance(node, ds.MappableDataset):
        raise ValueError(f"trainerd_dataset reads the samples by index, which a {name} cannot do: give it {_INDEXED}, "
                         f"or {_OWN_DATASET}")
    if isinstance(node, ds.GeneratorDataset):
        if not (hasattr(node.source, "__getitem__") and hasattr(node.source, "__len__")):
            raise ValueError("trainerd_dataset needs a GeneratorDataset over a random-access source (__getitem__ "
                             f"and __len__), not over a {type(node.source).__name__}")
        if node.has_batch_sampler or node.collate_fn is not None:
            raise ValueError("trainerd_dataset does not take a GeneratorDataset with batch_sampler or collate_fn: "
                             "it batches by step itself")
    if node.sampler is not None and node.sampler.child_sampler is not None:
        raise ValueError(f"trainerd_dataset replaces the {name}'s sampler, and it has a chain of them: build it "
                         "without sampler=")
    return node


def _sample_count(source: ds.MappableDataset) -> int:
    """The samples the stream draws from: the source's, or its `num_samples` when that is fewer."""
    if isinstance(source, ds.GeneratorDataset):
        count = len(source.source)
    else:
        source.use_sampler(ds.SequentialSampler())  # counted without the script's sharding
        count = source.get_dataset_size()
    return min(count, source.num_samples) if source.num_samples else count


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
                             f"{ctx.batch.micro_batch} ({MICRO_BATCH_ENV})")
        return ctx.batch
    return BatchSettings.for_world(batch_size * world_size, batch_size, world_size)


def _resume_position(ctx: RankContext, seed: int, who: str = "trainerd_dataset") -> ResumePosition:
    """Where TRAINERD_RESUME_FROM stands, from its manifest (TrainerdCallback loads and verifies the tensors
    when training begins); exits as the coordinator expects when the checkpoint cannot be used."""
    try:
        return resume_position(ctx.checkpoints, seed) or ResumePosition(0, 0)
    except ResumeError as exc:
        print(f"{who}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from exc
