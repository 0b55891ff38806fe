"""One rank's training under trainerd, whichever loop drives it: `TrainerdCallback` (Model.train) and
`TrainerdLoop` (a loop of the script's own) both hand it each step's figures.

It resumes the cells' parameters from the checkpoint trainerd chose before the first step (exiting with the
status the coordinator acts on when that fails), and keeps the global step, the stream position and the place
in the dataset's epochs; after each step it reports progress and bad batches to the agent and lets the
checkpoints save (on the schedule, or when the coordinator asks).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Mapping, Sequence
from typing import NoReturn

import mindspore.dataset as ds
from mindspore import nn

from proto.exit_codes import EXIT_USAGE
from proto.progress_datagram import GuardNotice, WorkerEvent
from trainer.checkpoint.manifest import EpochPosition
from trainer.checkpoint.sharding import ShardedTensor
from trainer.data.sampler import SampleStream
from trainer.data.skip_ranges import SkipRanges
from trainer.runtime.checkpointing import ResumeError, TrainingCheckpoints
from trainer.runtime.elastic_dataset import (
    OWN_DATASET_SEED,
    find_epoch_sampler,
    own_dataset_position,
)
from trainer.runtime.guard_policy import skip_reason
from trainer.runtime.progress import ProgressReporter, StepPace
from trainer.runtime.rank_context import RankContext
from trainer.runtime.step_replay import MAX_SPIKES_IN_WINDOW, SPIKE_WINDOW, Attempt, StepOutcome, Verdict

log = logging.getLogger(__name__)


class TrainingRun:
    """The global step, the stream position, the place in the epochs, and the checkpoints of one run."""

    def __init__(self, ctx: RankContext, reporter: ProgressReporter, checkpoints: TrainingCheckpoints,
                 stream: SampleStream, global_batch: int, epoch_position: EpochPosition | None, step: int,
                 consumed: int) -> None:
        self.ctx = ctx
        self.reporter = reporter
        self.checkpoints = checkpoints
        self.stream = stream
        self.global_batch = global_batch
        # Where training stands in the dataset's epochs (None: a dataset of unknown size, no epochs known).
        self.epoch_position = epoch_position
        self.step = step
        self.consumed = consumed
        self.step_started = time.perf_counter()
        self.pace = StepPace()
        self.where = f"job {ctx.job} generation {ctx.generation} rank {ctx.rank}/{ctx.world_size}"

    @classmethod
    def begin(cls, who: str, ctx: RankContext, reporter: ProgressReporter, cells: Sequence[nn.Cell],
              dataset: ds.Dataset, sharded: Mapping[str, ShardedTensor], skips_file: str | None) -> TrainingRun:
        """Resume into the parameters of `cells` (exiting as the coordinator expects when that fails), and
        report `started`. `who` names the caller in the one line an exit prints."""
        sampler = find_epoch_sampler(dataset)
        grad_accum = ctx.batch.grad_accum if ctx.batch is not None else 1
        if sampler is not None:
            stream, global_batch = sampler.stream, sampler.global_batch
        else:
            # Not trainerd's stream: positions and bad-batch ranges count samples, no more.
            stream = SampleStream(1, OWN_DATASET_SEED, SkipRanges.read(skips_file) if skips_file else SkipRanges())
            global_batch = ctx.batch.global_batch if ctx.batch is not None else \
                dataset.get_batch_size() * ctx.world_size
            log.warning("Job %s generation %d rank %s: the dataset was not built by trainerd_dataset: a resume goes "
                        "on at the step and in the epoch it stopped (resume_epoch), with whatever samples the "
                        "dataset reads there.", ctx.job, ctx.generation, ctx.rank)
        try:
            checkpoints = TrainingCheckpoints(ctx, ctx.checkpoints, reporter, cells, data_seed=stream.seed,
                                              grad_accumulation=grad_accum, skip_ledger=stream.ledger.ranges,
                                              sharded=sharded)
            start = checkpoints.resume()
        except ValueError as exc:
            exit_with(who, str(exc), EXIT_USAGE)
        except ResumeError as exc:
            exit_with(who, str(exc), exc.exit_code)
        if sampler is not None and (start.step, start.consumed_samples) != (sampler.first_step,
                                                                             sampler.first_consumed):
            exit_with(who, f"the dataset starts after step {sampler.first_step} at sample {sampler.first_consumed}, "
                      f"but the checkpoint after step {start.step} at sample {start.consumed_samples}", EXIT_USAGE)
        if sampler is not None:
            position: EpochPosition | None = EpochPosition(sampler.first_epoch - 1, sampler.skipped_steps,
                                                           sampler.steps_per_epoch)
        else:
            try:
                position = own_dataset_position(dataset, start)
            except ValueError:
                position = None  # no epochs known: Model.train's are not checked, nor kept in checkpoints
        run = cls(ctx, reporter, checkpoints, stream, global_batch, position, start.step, start.consumed_samples)
        reporter.event(WorkerEvent.STARTED, step=start.step)
        log.info("%s: training from step %d (sample %d), global batch %d", run.where, start.step,
                 start.consumed_samples, global_batch)
        return run

    def epoch_to_begin(self) -> int | None:
        """The epoch (counting from 1) the dataset is in, the one that must begin next; None when unknown."""
        return None if self.epoch_position is None else self.epoch_position.completed + 1

    def step_ended(self, loss: float, grad_norm: float, accepted: bool, epoch: int,
                   outcome: StepOutcome | None = None) -> None:
        """One step ended: its loss and norm, whether its update was applied, and, from a train cell that
        replays refused steps, what it was (without one, a refused step is taken for bad data)."""
        self.step += 1
        positions, self.consumed = self.stream.step_positions(self.consumed, self.global_batch)
        if outcome is None:
            reason = skip_reason(accepted, loss, grad_norm)
            outcome = StepOutcome(Verdict.ACCEPTED if reason is None else Verdict.BAD_DATA,
                                  Attempt(loss, grad_norm, accepted, math.nan), reason=reason)
        settle_outcome(self.reporter, self.checkpoints, self.where, self.ctx.rank, self.step,
                       (int(positions[0]), self.consumed), outcome)
        self.reporter.step(self.step, loss, grad_norm, self.pace.step_ended(self.global_batch, self.step_started),
                           self.consumed, epoch)
        self.checkpoints.after_step(self.step, self.consumed, self._advance_epoch_position())

    def finished(self) -> None:
        """Training ended: wait for a save in flight, and report `finished`."""
        self.checkpoints.close()
        self.reporter.event(WorkerEvent.FINISHED, step=self.step)

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


def settle_outcome(reporter: ProgressReporter, checkpoints: TrainingCheckpoints, where: str, rank: int | None,
                   step: int, samples: tuple[int, int], outcome: StepOutcome) -> None:
    """Log and report what became of step `step` (global samples [start, end)): bad data goes into the
    checkpoints' skip ledger on every rank and is reported by rank 0; a device fault is reported by each rank
    whose own result differed on the replay; a rebaselined guard is reported by rank 0."""
    verdict, (start, end) = outcome.verdict, samples
    if verdict is Verdict.ACCEPTED:
        return
    if verdict is Verdict.BAD_DATA:
        log.warning("%s: step %d skipped as bad data (%s), samples %d:%d", where, step, outcome.describe(), start,
                    end)
        checkpoints.record_skip(start, end)
        if rank == 0 and outcome.reason is not None:
            reporter.bad_batch(step, start, end, outcome.reason, outcome.standing.loss, outcome.standing.norm)
    elif verdict is Verdict.DEVICE_FAULT:
        mine = "this rank's gradients differed on the replay" if outcome.local_differs else "another rank's did"
        log.warning("%s: step %d came out otherwise on its replay (%s): %s; the replay stands, no samples skipped",
                    where, step, outcome.describe(), mine)
        if outcome.local_differs:
            reporter.guard_notice(step, GuardNotice.DEVICE_SUSPECTED, outcome.describe())
    elif verdict is Verdict.REBASELINED:
        log.warning("%s: step %d made more than %d reproduced spikes in %d steps (%s): the rule is out of step "
                    "with training, so the guard learns its statistics afresh and no samples are skipped", where,
                    step, MAX_SPIKES_IN_WINDOW, SPIKE_WINDOW, outcome.describe())
        if rank == 0:
            reporter.guard_notice(step, GuardNotice.GUARD_REBASELINED, outcome.describe())
    else:
        log.info("%s: step %d: a spike of the norm with an ordinary loss, reproduced (%s): applied", where, step,
                 outcome.describe())


def exit_with(who: str, message: str, code: int) -> NoReturn:
    """End the process with the status the coordinator acts on, and its reason in one line."""
    print(f"{who}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)
