"""trainerd for a training loop of the script's own (MindSpore's functional style: `value_and_grad` and an
optimizer call per batch), as `TrainerdCallback` is for `Model.train`:

    from trainer.runtime.loop import TrainerdLoop, trainerd_dataset
    dataset = trainerd_dataset(dataset, BATCH_SIZE)                  # your dataset, instead of .batch(...)
    with TrainerdLoop(dataset, net, optimizer) as loop:             # resumes net and optimizer
        for epoch, batches in loop.epochs(EPOCHS):                   # the epochs left, counted from 1
            for data, label in batches:
                loss, grads = grad_fn(data, label)
                grads = grad_reducer(grads)                          # data parallel: the ranks' mean
                if loop.accepts(grads):                              # optional: the bad-batch guard
                    optimizer(grads)
                loop.step_ended(loss)                               # progress; a checkpoint when due or asked
            for data, label in loop.evaluating(valid.create_tuple_iterator()):   # optional: a validation pass
                ...

What it gives: the parameters of the cells passed (the network and the optimizer, whose state is Parameters
too) resumed from the checkpoint trainerd chose, at any world size, before the first step; each step's loss
(and gradient norm, when given) and samples/s reported to the agent; trainerd's checkpoints after every
TRAINERD_CHECKPOINT_EVERY-th step and at the step the coordinator asks for; and the data where the checkpoint
left it, inside an epoch too. A dataset of the script's own (batched already: one `trainerd_dataset` cannot
take) resumes at the checkpoint's step of its epoch instead, whatever samples it reads there
(`elastic_dataset.resume_epoch`).

Why `loop.epochs` and not `for data, label in dataset` once per epoch, as MindSpore's tutorials write it:
each `for` over a MindSpore dataset builds a new iterator, which starts the dataset's sampler again at its
first pass, so every epoch would read the first one's samples again. `epochs` builds one iterator for the
epochs left, and each `for` over `batches` reads the next epoch.

The bad-batch guard, `loop.accepts(grads)` before the optimizer call, is the one GuardedTrainOneStepCell
applies inside Model.train's step (`trainer.runtime.guard`, the job's `data_skip` settings): it judges the
global norm of the gradients passed, which are the same on every rank once all-reduced, so every rank
decides alike; False (a non-finite norm, or a spike) means leave the update out. `step_ended` then reports
the step as a bad batch, its samples go into the skip ledger of later checkpoints, and after
`max_consecutive_spikes` of them in a row the coordinator rolls back and skips them. The guard's state is
saved with the cells, so a resumed run judges as the uninterrupted one would. A loop that does not call
`accepts` has no guard: a non-finite loss is reported as a step like any other.

An evaluation between steps makes no step: iterate its batches through `loop.evaluating(...)`, which tells the
agent the rank evaluates, so that one longer than the job's hang_timeout_s is no hang.

Data parallel only (MindSpore's stand_alone or data_parallel mode): the cells' parameters are saved whole.
A script whose parameters tensor or optimizer parallel cuts uses Model.train with TrainerdCallback, which
saves each rank's slices.

Outside trainerd (run by hand, or by msrun: TRAINERD_JOB is not set) it logs one line and reports and saves
nothing; `accepts` still guards, and `epochs` still reads the dataset's epochs one after another, so the
script runs as before.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import mindspore as ms
import mindspore.dataset as ds
import numpy as np
from mindspore import Tensor, nn, ops

from proto.exit_codes import EXIT_USAGE
from proto.launch_env import JOB_ENV, SKIPS_FILE_ENV
from trainer.runtime.elastic_dataset import resume_epoch, trainerd_dataset
from trainer.runtime.guard import NOT_FORCED, StepGuard
from trainer.runtime.guard_policy import GuardSettings
from trainer.runtime.progress import ProgressReporter
from trainer.runtime.rank_context import trainerd_launch
from trainer.runtime.training_run import TrainingRun, exit_with

__all__ = ["TrainerdLoop", "trainerd_dataset"]

log = logging.getLogger(__name__)
_WHO = "TrainerdLoop"
_WHOLE_PARAMETER_MODES = ("stand_alone", "data_parallel")
T = TypeVar("T")


class TrainerdLoop:
    """One rank's training loop under trainerd: resume at construction, `epochs` to iterate, `step_ended` after
    each step. Use it as a context manager: leaving the block normally reports the run finished; leaving it
    by an exception waits for a save in flight and lets the exception end the process."""

    def __init__(self, dataset: ds.Dataset, *cells: nn.Cell, environ: Mapping[str, str] | None = None) -> None:
        if not cells:
            raise ValueError("TrainerdLoop needs the cells whose parameters it saves and resumes "
                             "(the network and the optimizer)")
        env = os.environ if environ is None else environ
        ctx = trainerd_launch(env)
        self._dataset = dataset
        self._epoch = resume_epoch(dataset) + 1
        self._run: TrainingRun | None = None
        self._reporter: ProgressReporter | None = None
        self._judged: tuple[float, bool] | None = None  # this step's (norm, accepted), once `accepts` ran
        try:
            guard = StepGuard(GuardSettings.from_environ(env))
        except ValueError as exc:
            exit_with(_WHO, str(exc), EXIT_USAGE)
        self._judge = _GradientJudge(guard)
        if ctx is None:
            log.warning(f"TrainerdLoop: this process was not launched by trainerd ({JOB_ENV} is not set), "
                        "so it reports no progress and saves no checkpoints.")
            return
        if ctx.is_scheduler:
            return
        mode = ms.get_auto_parallel_context("parallel_mode")
        if mode not in _WHOLE_PARAMETER_MODES:
            exit_with(_WHO, f"the parallel mode is {mode}, whose parameters may be cut over the ranks, and "
                      "TrainerdLoop saves every parameter whole: use Model.train with TrainerdCallback", EXIT_USAGE)
        self._reporter = ProgressReporter.for_rank(ctx)
        self._run = TrainingRun.begin(_WHO, ctx, self._reporter, (*cells, guard), dataset, {},
                                      env.get(SKIPS_FILE_ENV))

    def epochs(self, total: int) -> Iterator[tuple[int, Iterator[Any]]]:
        """(epoch, batches) for each epoch from the one training resumes in up to `total` (counting from 1);
        iterate `batches` once per epoch. Nothing when the resumed checkpoint already ended epoch `total`."""
        if total < self._epoch:
            return
        batches = self._dataset.create_tuple_iterator(num_epochs=total - self._epoch + 1)
        for epoch in range(self._epoch, total + 1):
            self._epoch = epoch
            if self._run is not None:
                self._run.step_started = time.perf_counter()
            yield epoch, batches

    def accepts(self, grads: Sequence[Tensor]) -> bool:
        """Whether to apply this step's update: the guard's judgement of the global norm of `grads` (after the
        all-reduce, so that every rank judges the same numbers). Call it at most once a step, before
        `step_ended`, which reports a refused step as a bad batch."""
        norm, accepted = self._judge(*grads)
        self._judged = (float(norm.asnumpy()), bool(accepted.asnumpy()))
        return self._judged[1]

    def step_ended(self, loss: Tensor | float, grad_norm: Tensor | float | None = None) -> None:
        """One step is done: its loss (a Tensor is averaged) and, when the loop computes it and did not call
        `accepts`, the global gradient norm."""
        judged, self._judged = self._judged, None
        if self._run is None:
            return
        if judged is not None:
            norm, accepted = judged
        else:
            norm, accepted = (math.nan if grad_norm is None else _number(grad_norm)), True
        self._run.step_ended(_number(loss), norm, accepted, self._epoch)

    def evaluating(self, batches: Iterable[T]) -> Iterator[T]:
        """`batches` of an evaluation the loop runs between its steps (a validation pass each epoch), passed
        through. An evaluation makes no step, so one longer than the job's hang_timeout_s would be taken for a
        hang: as it begins, and every few seconds while its batches come, this tells the agent that the rank
        evaluates. A rank stuck inside it stops telling it, and is a hang."""
        first = True
        for batch in batches:
            self._tell_evaluating(first)
            first = False
            yield batch

    def _tell_evaluating(self, first: bool) -> None:
        if self._run is not None and self._reporter is not None:
            self._reporter.evaluating(self._run.step, first)

    def __enter__(self) -> TrainerdLoop:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._run is not None:
            if exc_type is None:
                self._run.finished()
            else:
                self._run.checkpoints.close()
        if self._reporter is not None:
            self._reporter.close()


class _GradientJudge(nn.Cell):
    """`judge(*grads) -> (norm, accepted)`: the global norm of the gradients and the guard's decision on it. A
    Cell, so that it compiles into one graph (and is safe with MindSpore's compile cache); the gradients come
    as separate arguments, since MindSpore takes a tuple argument's Tensors for constants."""

    def __init__(self, guard: StepGuard) -> None:
        super().__init__(auto_prefix=False)
        self.guard = guard

    def construct(self, *grads: Tensor) -> tuple[Tensor, Tensor]:
        norm = ops.sqrt(ops.addn([ops.reduce_sum(ops.square(grad)) for grad in grads]))
        return norm, self.guard(norm, norm, NOT_FORCED)  # a non-finite norm fails the guard's loss check too


def _number(value: Tensor | float) -> float:
    return float(np.mean(value.asnumpy())) if isinstance(value, Tensor) else float(value)
