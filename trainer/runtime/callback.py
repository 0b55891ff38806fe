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
sinks), where callbacks see every step. Replace ModelCheckpoint rather than keep it: a script resuming from its own
checkpoints would start Model.train at an epoch of its own, which the callback refuses.

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
import sys
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, NoReturn

import numpy as np
from mindspore import Tensor
from mindspore.train import Callback, RunContext

from proto.exit_codes import EXIT_USAGE
from proto.progress_datagram import BadBatchReason, WorkerEvent
from trainer.checkpoint.errors import UnsupportedLayout
from trainer.checkpoint.manifest import EpochPosition
from trainer.checkpoint.sharding import ShardedTensor
from trainer.data.mindspore_sampler import EpochSampler
from trainer.data.sampler import SampleStream
from trainer.data.skip_ranges import SkipRanges
from trainer.runtime.checkpointing import ResumeError, TrainingCheckpoints
from trainer.runtime.elastic_dataset import SKIPS_FILE_ENV, find_epoch_sampler, resume_epoch, trainerd_dataset
from trainer.runtime.guard_policy import skip_reason
from trainer.runtime.guarded_cell import GuardedTrainOneStepCell
from trainer.runtime.parameter_layouts import parameter_layouts
from trainer.runtime.progress import ProgressReporter, StepPace
from trainer.runtime.rank_context import RankContext, trainerd_launch

__all__ = ["GuardedTrainOneStepCell", "TrainerdCallback", "resume_epoch", "trainerd_dataset"]

log = logging.getLogger(__name__)


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
        self._run: _Run | None = None
        if ctx is None:
            log.warning("TrainerdCallback: this process was not launched by trainerd (TRAINERD_JOB is not set), "
                        "so it reports no progress and saves no checkpoints.")
        elif not ctx.is_scheduler:  # the scheduler never trains: MindSpore's init() serves the cluster
            self._active = (ctx, ProgressReporter.for_rank(ctx))

    def on_train_begin(self, run_context: RunContext) -> None:
        if self._active is not None:
            self._run = _Run.begin(*self._active, run_context.original_args(), self._skips_file)

    def on_train_epoch_begin(self, run_context: RunContext) -> None:
        if self._run is not None:
            self._run.check_epoch(run_context.original_args().cur_epoch_num)

    def on_train_step_begin(self, run_context: RunContext) -> None:
        if self._run is not None:
            self._run.step_started = time.perf_counter()

    def on_train_step_end(self, run_context: RunContext) -> None:
        if self._run is not None:
            cb_params = run_context.original_args()
            self._run.step_ended(cb_params.net_outputs, isinstance(cb_params.train_network, GuardedTrainOneStepCell),
                                 cb_params.cur_epoch_num)

    def on_train_end(self, run_context: RunContext) -> None:
        if self._run is not None:
            self._run.checkpoints.close()
            self._run.reporter.event(WorkerEvent.FINISHED, step=self._run.step)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Model.train leaves its callbacks' contexts also when training fails: wait for a save in flight."""
        if self._run is not None:
            self._run.checkpoints.close()
        if self._active is not None:
            self._active[1].close()


class _Run:
    """One Model.train call: the global step, the stream position, and the checkpoints."""

    def __init__(self, ctx: RankContext, reporter: ProgressReporter, checkpoints: TrainingCheckpoints,
                 stream: SampleStream, global_batch: int, sampler: EpochSampler | None, step: int,
                 consumed: int) -> None:
        self.ctx = ctx
        self.reporter = reporter
        self.checkpoints = checkpoints
        self.stream = stream
        self.global_batch = global_batch
        # Where Model.train stands in the dataset's epochs (None: not trainerd_dataset's, no epochs known).
        self.epoch_position = None if sampler is None else EpochPosition(
            sampler.first_epoch - 1, sampler.skipped_steps, sampler.steps_per_epoch)
        self.step = step
        self.consumed = consumed
        self.step_started = time.perf_counter()
        self.pace = StepPace()
        self.where = f"job {ctx.job} generation {ctx.generation} rank {ctx.rank}/{ctx.world_size}"

    @classmethod
    def begin(cls, ctx: RankContext, reporter: ProgressReporter, cb_params: Any, skips_file: str | None) -> _Run:
        """Resume into the train network's parameters (exiting as the coordinator expects when that fails),
        and report `started`."""
        if cb_params.dataset_sink_mode:
            _exit("Model.train runs with dataset_sink_mode=True, where callbacks see an epoch, not a step: "
                  "pass dataset_sink_mode=False", EXIT_USAGE)
        sampler = find_epoch_sampler(cb_params.train_dataset)
        grad_accum = ctx.batch.grad_accum if ctx.batch is not None else 1
        if sampler is not None:
            stream, global_batch = sampler.stream, sampler.global_batch
        else:
            # Not trainerd's stream: positions and bad-batch ranges count samples, no more.
            stream = SampleStream(1, 0, SkipRanges.read(skips_file) if skips_file else SkipRanges())
            global_batch = ctx.batch.global_batch if ctx.batch is not None else \
                cb_params.train_dataset.get_batch_size() * ctx.world_size
            log.warning("Job %s generation %d rank %s: the dataset was not built by trainerd_dataset, so a resume "
                        "restores the weights and the step but not the data position.", ctx.job, ctx.generation,
                        ctx.rank)
        sharded = _sharded_parameters(ctx, cb_params)
        try:
            checkpoints = TrainingCheckpoints(ctx, ctx.checkpoints, reporter, (cb_params.train_network,),
                                              data_seed=stream.seed, grad_accumulation=grad_accum,
                                              skip_ledger=stream.ledger.ranges, sharded=sharded)
            start = checkpoints.resume()
        except ValueError as exc:
            _exit(str(exc), EXIT_USAGE)
        except ResumeError as exc:
            _exit(str(exc), exc.exit_code)
        if sampler is not None and (start.step, start.consumed_samples) != (sampler.first_step,
                                                                             sampler.first_consumed):
            _exit(f"the dataset starts after step {sampler.first_step} at sample {sampler.first_consumed}, but the "
                  f"checkpoint after step {start.step} at sample {start.consumed_samples}", EXIT_USAGE)
        # Model.train counts this call's steps from 0; MindSpore's own resume starts the count at the global
        # step (Model._train's initial_step), so LossMonitor prints the step within the epoch.
        cb_params.cur_step_num = start.step
        run = cls(ctx, reporter, checkpoints, stream, global_batch, sampler, start.step, start.consumed_samples)
        reporter.event(WorkerEvent.STARTED, step=start.step)
        log.info("%s: training from step %d (sample %d), global batch %d", run.where, start.step,
                 start.consumed_samples, global_batch)
        return run

    def check_epoch(self, epoch: int) -> None:
        """The dataset's epochs and Model.train's must agree; they do not when initial_epoch is wrong."""
        if self.epoch_position is None:
            return
        expected = self.epoch_position.completed + 1
        if epoch != expected:
            _exit(f"Model.train began epoch {epoch}, but the dataset is in epoch {expected} (after step "
                  f"{self.step}): pass initial_epoch=resume_epoch(dataset) to Model.train", EXIT_USAGE)

    def step_ended(self, outputs: Any, guarded: bool, epoch: int) -> None:
        loss, grad_norm, accepted = _read_outputs(outputs, guarded)
        self.step += 1
        positions, self.consumed = self.stream.step_positions(self.consumed, self.global_batch)
        reason = skip_reason(accepted, loss, grad_norm)
        if reason is not None:
            start = int(positions[0])
            log.warning("%s: step %d skipped (%s): loss %.4g grad norm %.4g, samples %d:%d", self.where, self.step,
                        reason, loss, grad_norm, start, self.consumed)
            self.checkpoints.record_skip(start, self.consumed)
            if self.ctx.rank == 0:
                self.reporter.bad_batch(self.step, start, self.consumed, BadBatchReason(reason), loss, grad_norm)
        self.reporter.step(self.step, loss, grad_norm, self.pace.step_ended(self.global_batch, self.step_started),
                           self.consumed, epoch)
        self.checkpoints.after_step(self.step, self.consumed, self._advance_epoch_position())

    def _advance_epoch_position(self) -> EpochPosition | None:
        """Moves the place in the epochs one step on and returns it: what the checkpoint of this step keeps."""
        position = self.epoch_position
        if position is None:
            return None
        completed, done = position.completed, position.steps_done + 1
        if done == position.steps_per_epoch:
            completed, done = completed + 1, 0
        self.epoch_position = EpochPosition(completed, done, position.steps_per_epoch)
        return self.epoch_position


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
    """End the process with the status the coordinator acts on, and its reason in one line."""
    print(f"TrainerdCallback: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)
