"""trainerd for a `Model.train` script: one callback, a guarded train cell and the elastic dataset.

The recipe (the lines a script written for msrun adds or changes; `callback_style.py` in the integration
tests is `msrun_style.py` converted this way):

    from trainer.runtime.callback import GuardedTrainOneStepCell, TrainerdCallback, resume_epoch, trainerd_dataset
    dataset = trainerd_dataset(dataset, BATCH_SIZE, steps_per_epoch)     # instead of .batch(...)(.take(...))
    model = Model(GuardedTrainOneStepCell(nn.WithLossCell(net, loss_fn), optimizer))
    callbacks = [TrainerdCallback(), LossMonitor(1), ...]               # instead of ModelCheckpoint
    model.train(epochs, dataset, callbacks=callbacks, initial_epoch=resume_epoch(dataset))

What each gives:
- TrainerdCallback: step reports (step, loss, samples/s, and the gradient norm when the train cell gives
  one) and the `started`/`finished` events to the agent; trainerd's sharded checkpoints of every parameter of
  Model's train network (network, optimizer, guard) after every TRAINERD_CHECKPOINT_EVERY-th step and at
  the step the coordinator asks for, each reported once committed; resume from TRAINERD_RESUME_FROM at any
  world size, loaded into the parameters before the first step; a bad-batch report, and the range in later
  checkpoints' skip ledger, for each step the guarded cell skipped. Under semi-auto or auto parallel
  (tensor and optimizer parallel) each rank saves and resumes its own slices of the parameters MindSpore
  cuts (`trainer.runtime.parameter_layouts`); a layout the checkpoint cannot represent exactly (uneven
  splits, pipeline stages, ...) is refused before the first step.
- trainerd_dataset (`trainer.runtime.elastic_dataset`): the seeded sample stream, split by rank, without
  the skip ledger's ranges, positioned at the checkpoint's consumed samples; resume_epoch(dataset) tells
  Model.train the epoch to continue in (MindSpore offers no other way in).
- GuardedTrainOneStepCell (`trainer.runtime.guarded_cell`): the update of a non-finite or spiking step is
  skipped inside the step on every rank; micro batches accumulate when the launch splits the global batch.
Each part works without the others, but exact data resume needs trainerd_dataset, and bad-batch reports
need the guarded cell. Model.train must run with dataset_sink_mode=False (its default in 2.10; CPU never
sinks), where callbacks see every step.

What a resume needs is told at the job's first start (`trainer.runtime.epoch_agreement`): Model.train running
several epochs of a dataset of the script's own that resume_epoch never saw is refused there (exit 2, one
line), and a ModelCheckpoint beside the callback is a `job_warning` (replace it rather than keep it: a script
resuming from its own checkpoints starts Model.train at an epoch of its own). At a resume, Model.train begun
behind the dataset's epoch (initial_epoch not from resume_epoch) is renumbered as the dataset's epochs and
stopped after the last one asked for, with a warning; Model.train ahead of it would end early and is refused.

Outside trainerd (run by hand, or by msrun: TRAINERD_JOB is not set) the callback logs one line and does
nothing; the cell still guards, and the dataset still reads the stream, so the script runs as before.

Costs per step: one read of the step's outputs to the host (the loss, as LossMonitor does; the norm and
the decision come with it), one datagram, one `stat` of the control file: about 0.1-0.2 ms of Python on
this project's 2-core CPU machine. A save blocks only while the parameters are copied to host memory
(`trainer.runtime.checkpointing`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, NoReturn

import numpy as np
from mindspore import Tensor
from mindspore.train import Callback, ModelCheckpoint, RunContext

from proto.exit_codes import EXIT_USAGE
from proto.launch_env import JOB_ENV, SKIPS_FILE_ENV
from trainer.checkpoint.errors import UnsupportedLayout
from trainer.checkpoint.sharding import ShardedTensor
from trainer.runtime.elastic_dataset import positioned_for_resume, resume_epoch, trainerd_dataset
from trainer.runtime.epoch_agreement import (
    RESUME_EPOCH_ADVICE,
    epoch_shift,
    model_checkpoint_warning,
    unpositioned_dataset_refusal,
)
from trainer.runtime.evaluation_watch import watch_model_eval
from trainer.runtime.guarded_cell import GuardedTrainOneStepCell
from trainer.runtime.parameter_layouts import parameter_layouts
from trainer.runtime.progress import ProgressReporter
from trainer.runtime.rank_context import RankContext, trainerd_launch
from trainer.runtime.training_run import TrainingRun, exit_with

__all__ = ["GuardedTrainOneStepCell", "TrainerdCallback", "resume_epoch", "trainerd_dataset"]

log = logging.getLogger(__name__)
_WHO = "TrainerdCallback"  # how its one-line exits begin


class TrainerdCallback(Callback):
    """Progress, checkpoints, resume and bad-batch reports for one rank of a `Model.train` job under trainerd.

    Give it to one `Model.train` call per process. `environ` defaults to the process environment.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        super().__init__()
        env = os.environ if environ is None else environ
        ctx = trainerd_launch(env)
        self._skips_file = env.get(SKIPS_FILE_ENV)
        self._active: tuple[RankContext, ProgressReporter] | None = None
        self._run: TrainingRun | None = None
        # Epochs by which Model.train's count is behind the dataset's (None: no epoch begun yet), and the last
        # epoch Model.train was asked for (`epoch_agreement`).
        self._epoch_shift: int | None = None
        self._last_epoch = 0
        self._entered = 0  # Model.fit enters the callbacks again for each evaluation, inside the training's
        self._unwatch_eval: Callable[[], None] = lambda: None
        if ctx is None:
            log.warning(f"TrainerdCallback: this process was not launched by trainerd ({JOB_ENV} is not set), "
                        "so it reports no progress and saves no checkpoints.")
        elif not ctx.is_scheduler:  # the scheduler never trains: MindSpore's init() serves the cluster
            self._active = (ctx, ProgressReporter.for_rank(ctx))

    def on_train_begin(self, run_context: RunContext) -> None:
        """Resume into the train network before the first step."""
        if self._active is None:
            return
        ctx, reporter = self._active
        cb_params = run_context.original_args()
        if cb_params.dataset_sink_mode:
            _exit("Model.train runs with dataset_sink_mode=True, where callbacks see an epoch, not a step: "
                  "pass dataset_sink_mode=False", EXIT_USAGE)
        dataset = cb_params.train_dataset
        size = dataset.get_dataset_size()
        refusal = unpositioned_dataset_refusal(cb_params.epoch_num, positioned_for_resume(dataset),
                                               size is not None and size > 0)
        if refusal is not None:
            _exit(refusal, EXIT_USAGE)
        self._run = TrainingRun.begin(_WHO, ctx, reporter, (cb_params.train_network,), dataset,
                                      _sharded_parameters(ctx, cb_params), self._skips_file)
        if any(isinstance(callback, ModelCheckpoint) for callback in cb_params.list_callback):
            self._warn(model_checkpoint_warning())
        # Model.train counts this call's steps from 0; MindSpore's own resume starts the count at the global
        # step (Model._train's initial_step), so LossMonitor prints the step within the epoch.
        cb_params.cur_step_num = self._run.step
        self._unwatch_eval = watch_model_eval(self._evaluating)

    def on_train_epoch_begin(self, run_context: RunContext) -> None:
        """The dataset's epochs and Model.train's must agree. When Model.train began behind a dataset positioned
        for the resume (initial_epoch not from resume_epoch), its epochs are renumbered as the dataset's here
        (the callbacks' step and epoch ends see the dataset's number) and it is stopped after its last one;
        what cannot be mended exits (`epoch_agreement`)."""
        if self._run is None or self._active is None:
            return
        cb_params = run_context.original_args()
        epoch, expected = cb_params.cur_epoch_num, self._run.epoch_to_begin()
        if self._epoch_shift is None:  # Model.train's first epoch
            self._last_epoch = epoch + cb_params.epoch_num - 1  # Model.train's `epoch`: the epochs asked for
            self._epoch_shift = 0 if expected is None else self._agree(epoch, expected, cb_params.train_dataset)
        epoch = cb_params.cur_epoch_num = epoch + self._epoch_shift
        if expected is not None and epoch != expected:
            _exit(f"Model.train began epoch {epoch}, but the dataset is in epoch {expected} (after step "
                  f"{self._run.step}): {RESUME_EPOCH_ADVICE}", EXIT_USAGE)

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        """Model.train renumbered from behind would go on past the last epoch asked for: stop it there."""
        if self._epoch_shift and run_context.original_args().cur_epoch_num >= self._last_epoch:
            run_context.request_stop()

    def _agree(self, epoch: int, expected: int, dataset: Any) -> int:
        """The epochs by which Model.train, beginning `epoch`, is renumbered to the dataset's `expected`;
        exits (usage) when it cannot be."""
        assert self._run is not None and self._active is not None
        shift = epoch_shift(epoch, expected, positioned_for_resume(dataset))
        if shift is None and epoch > expected:
            _exit(f"Model.train began epoch {epoch}, but trainerd's checkpoint is in epoch {expected} (after step "
                  f"{self._run.step}), so Model.train would end {epoch - expected} epochs early (an initial_epoch "
                  f"from a checkpoint of the script's own?): {RESUME_EPOCH_ADVICE}", EXIT_USAGE)
        if shift is None:
            _exit(f"Model.train began epoch {epoch}, but the dataset is in epoch {expected} (after step "
                  f"{self._run.step}): {RESUME_EPOCH_ADVICE}", EXIT_USAGE)
        if shift:
            self._warn(f"Model.train began epoch {epoch}, but trainerd's checkpoint is in epoch "
                       f"{expected} (after step {self._run.step}): its epochs are counted as the dataset's, "
                       f"and it stops after epoch {self._last_epoch}; {RESUME_EPOCH_ADVICE} to avoid this")
        return shift

    def _warn(self, text: str) -> None:
        """Log `text`; rank 0 tells the coordinator too (every rank finds the same), as a job warning."""
        assert self._run is not None and self._active is not None
        log.warning("TrainerdCallback: %s", text)
        ctx, reporter = self._active
        if ctx.rank == 0:
            reporter.warning(self._run.step, text)

    def on_train_step_begin(self, run_context: RunContext) -> None:
        if self._run is not None:
            self._run.step_started = time.perf_counter()

    def on_train_step_end(self, run_context: RunContext) -> None:
        if self._run is not None:
            cb_params = run_context.original_args()
            network = cb_params.train_network
            guarded = isinstance(network, GuardedTrainOneStepCell)
            self._run.step_ended(*_read_outputs(cb_params.net_outputs, guarded), cb_params.cur_epoch_num,
                                 network.last_outcome if guarded else None)

    def on_eval_begin(self, run_context: RunContext) -> None:
        """Model.fit evaluates between epochs: no step for as long as that takes, which is no hang (a
        Model.eval that another callback runs is heard through evaluation_watch)."""
        self._evaluating(True)

    def on_eval_step_end(self, run_context: RunContext) -> None:
        self._evaluating(False)

    def _evaluating(self, first: bool) -> None:
        if self._run is not None and self._active is not None:
            self._active[1].evaluating(self._run.step, first)

    def on_train_end(self, run_context: RunContext) -> None:
        self._unwatch_eval()  # what runs after training awaits no step (the agent hears FINISHED)
        if self._run is not None:
            self._run.finished()

    def __enter__(self) -> "TrainerdCallback":
        self._entered += 1
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Model.train leaves its callbacks' contexts also when training fails: wait for a save in flight.
        Only the outermost exit closes: Model.fit's evaluation between epochs enters and leaves them too."""
        self._entered -= 1
        if self._entered > 0:
            return
        self._unwatch_eval()
        if self._run is not None:
            self._run.checkpoints.close()
        if self._active is not None:
            self._active[1].close()


def _sharded_parameters(ctx: RankContext, cb_params: Any) -> dict[str, ShardedTensor]:
    """The parameters tensor or optimizer parallel cuts, when checkpoints are kept; exits (usage) when their
    layout cannot be saved exactly."""
    if ctx.checkpoints.directory is None or ctx.rank is None:
        return {}
    try:
        sharded = parameter_layouts(cb_params.train_network, cb_params.train_dataset, ctx.rank, ctx.world_size)
    except UnsupportedLayout as exc:
        _exit(f"cannot checkpoint this parallel layout: {exc}", EXIT_USAGE)
    if sharded:
        log.info("Job %s generation %d rank %s: %d parameters are cut by tensor or optimizer parallel; this rank "
                 "saves its own slices of them.", ctx.job, ctx.generation, ctx.rank, len(sharded))
    return sharded


def _read_outputs(outputs: Any, guarded: bool) -> tuple[float, float, bool]:
    """(loss, grad norm, accepted) of one step: all three from the guarded cell; from another cell its loss
    (the first Tensor of a tuple, the mean of a Tensor), the norm unknown (NaN) and the step taken."""
    if guarded:
        loss, norm, accepted = outputs
        return float(loss.asnumpy()), float(norm.asnumpy()), bool(accepted.asnumpy())
    if isinstance(outputs, (tuple, list)):
        outputs = outputs[0]
    loss = float(np.mean(outputs.asnumpy())) if isinstance(outputs, Tensor) else math.nan
    return loss, math.nan, True


def _exit(message: str, code: int) -> NoReturn:
    exit_with(_WHO, message, code)
