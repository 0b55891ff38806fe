"""The MindFormers callback that reports a job's progress to trainerd.

Registered in MindFormers' registry as `TrainerdMindFormersCallback`; the launcher lists it under `callbacks:`
of each generation's YAML (with `auto_register`, which imports `register/trainerd_mindformers.py` from
`--register_path`). What it reports, through the agent's progress socket:

- every step: the global step (MindFormers counts on from the resumed step), the loss, the global norm
  and samples/s; the consumed samples are step × global batch;
- a step MindFormers skipped as a bad batch (rank 0): its update is skipped when the loss-scale overflow
  check fires (`overflow`) or, with `use_skip_data_by_global_norm`, when the global norm reaches
  `global_norm_spike_threshold`; the sample range is that step's global batch;
- an evaluation while it trains (`do_eval`: MindFormers' EvalCallBack runs `model.eval`), as it begins and every
  few seconds of it (`trainer.runtime.evaluation_watch`): no step for that long is no hang;
- every checkpoint MindFormers commits (rank 0): when `latest_checkpointed_iteration.txt` in the
  checkpoint directory names a new iteration, its `iteration_NNNNNNNN` directory (also after async saves,
  whose tracker rank 0 writes a step or more later). trainerd resumes later generations from it. Rank 0 then
  removes the iterations earlier generations left that fall out of the newest TRAINERD_CHECKPOINT_KEEP
  (`retention`): MindFormers removes only those its own process saved.

MindFormers' train cells return (loss, overflow, loss_scale, learning_rate, global_norm[, local norms]);
a cell without clipping gives no global norm, reported as NaN.

Outside trainerd (TRAINERD_JOB unset) it does nothing. It costs one host read of the loss and norm (as
MFLossMonitor does) and one `stat` of the tracker per step.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from mindformers.tools.register import MindFormerModuleType, MindFormerRegister
from mindspore import Tensor
from mindspore.train import Callback, RunContext

from proto.launch_env import JOB_ENV
from proto.progress_datagram import WorkerEvent
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.mindformers_import import TRACKER_FILE, committed_iteration, iteration_dir
from trainer.integrations.mindformers.retention import prune_earlier_iterations
from trainer.runtime.evaluation_watch import watch_model_eval
from trainer.runtime.guard_policy import skip_reason
from trainer.runtime.progress import ProgressReporter, StepPace
from trainer.runtime.rank_context import RankContext, trainerd_launch

log = logging.getLogger(__name__)


@MindFormerRegister.register(MindFormerModuleType.CALLBACK)
class TrainerdMindFormersCallback(Callback):
    """`global_batch_size`: samples per optimizer step across all ranks. `skip_norm_threshold`: MindFormers'
    global_norm_spike_threshold when use_skip_data_by_global_norm is on, else None. `initial_step`: the step
    resumed from (the launcher sets both from the generation's YAML and resume point). `checkpoint_dir`: where
    MindFormers commits checkpoints (default TRAINERD_CHECKPOINT_DIR)."""

    def __init__(self, global_batch_size: int, skip_norm_threshold: float | None = None, initial_step: int = 0,
                 checkpoint_dir: str | None = None, environ: Mapping[str, str] | None = None) -> None:
        super().__init__()
        env = os.environ if environ is None else environ
        self.global_batch = int(global_batch_size)
        self.initial_step = int(initial_step)
        self._offset = 0
        self.skip_norm_threshold = skip_norm_threshold
        ctx = trainerd_launch(env)
        self._ctx: RankContext | None = None if ctx is None or ctx.is_scheduler else ctx
        self._reporter = ProgressReporter.for_rank(self._ctx) if self._ctx is not None else None
        directory = checkpoint_dir or (str(ctx.checkpoints.directory) if ctx and ctx.checkpoints.directory else None)
        self._tracker = CommitTracker(Path(directory), self._ctx.checkpoints.keep) \
            if directory and self._ctx and self._ctx.rank == 0 else None
        self._step_started = time.perf_counter()
        self._pace = StepPace()
        self._unwatch_eval: Callable[[], None] = lambda: None
        self._step = 0
        self._resumed_from = 0
        if ctx is None:
            log.warning(f"TrainerdMindFormersCallback: not launched by trainerd ({JOB_ENV} is not set); "
                        "reporting nothing.")

    def on_train_begin(self, run_context: RunContext) -> None:
        if self._reporter is None:
            return
        # MindFormers 2.0.0 resumes without handing its initial step to Model.train, whose step count then
        # starts at 0 (its MFLossMonitor adds the step itself); count on from the resumed step either way.
        started = int(run_context.original_args().cur_step_num)
        self._offset = self.initial_step if started < self.initial_step else 0
        self._step = started + self._offset
        self._resumed_from = self._step
        if self._tracker is not None:
            # Report iterations after the resumed one, even where the tracker named a later one (a resume
            # from an older checkpoint): MindFormers rewrites the tracker at its next save.
            self._tracker.seen = self._step
        self._reporter.event(WorkerEvent.STARTED, step=self._step)
        self._unwatch_eval = watch_model_eval(self._evaluating)

    def on_train_step_begin(self, run_context: RunContext) -> None:
        self._step_started = time.perf_counter()

    def on_train_step_end(self, run_context: RunContext) -> None:
        if self._reporter is None:
            return
        cb_params = run_context.original_args()
        self._step = int(cb_params.cur_step_num) + self._offset
        loss, overflow, global_norm = read_outputs(cb_params.net_outputs)
        consumed = self._step * self.global_batch
        skipped = overflow or (self.skip_norm_threshold is not None and global_norm >= self.skip_norm_threshold)
        reason = skip_reason(not skipped, loss, global_norm)
        if reason is not None and self._ctx is not None and self._ctx.rank == 0:
            log.warning("step %d skipped by MindFormers (%s): loss %.4g, global norm %.4g", self._step, reason,
                        loss, global_norm)
            self._reporter.bad_batch(self._step, consumed - self.global_batch, consumed, reason, loss, global_norm)
        self._reporter.step(self._step, loss, global_norm, self._pace.step_ended(self.global_batch, self._step_started),
                            consumed)
        self._report_commit()

    def on_train_end(self, run_context: RunContext) -> None:
        self._unwatch_eval()
        if self._reporter is None:
            return
        self._report_commit()
        self._reporter.event(WorkerEvent.FINISHED, step=self._step)

    def _evaluating(self, first: bool) -> None:
        if self._reporter is not None:
            self._reporter.evaluating(self._step, first)

    def _report_commit(self) -> None:
        if self._tracker is None or self._reporter is None:
            return
        iteration = self._tracker.new_commit()
        if iteration is not None:
            path = iteration_dir(self._tracker.root, iteration)
            self._reporter.checkpoint(iteration, iteration * self.global_batch, str(path))
            log.info("checkpoint of step %d committed in %s", iteration, path)
            prune_earlier_iterations(self._tracker.root, self._tracker.keep, iteration, self._resumed_from)


class CommitTracker:
    """Watches Checkpoint 2.0's commit point, `latest_checkpointed_iteration.txt`, with one `stat` per call;
    `keep` is how many committed iterations retention keeps."""

    def __init__(self, root: Path, keep: int) -> None:
        self.root = root
        self.keep = keep
        self.seen: int | None = None
        self._stamp: tuple[int, int] | None = None

    def committed(self) -> int | None:
        try:
            return committed_iteration(self.root)
        except CheckpointError as exc:
            log.warning("%s", exc)
            return None

    def new_commit(self) -> int | None:
        """The iteration the tracker names when it changed since the last call and is newer than `seen`."""
        try:
            stat = (self.root / TRACKER_FILE).stat()
        except OSError:
            return None
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        iteration = self.committed()
        if iteration is None or (self.seen is not None and iteration <= self.seen):
            return None
        self.seen = iteration
        return iteration


def _scalar(value: Any) -> float:
    if isinstance(value, Tensor):
        value = value.asnumpy()
    if value is None:
        return math.nan
    return float(np.mean(value))


def read_outputs(outputs: Any) -> tuple[float, bool, float]:
    """(loss, overflow, global norm) of MindFormers' net outputs (loss, overflow, loss_scale, lr, global_norm
    [, local_norm, norm_size]); a bare loss means no overflow and an unknown (NaN) norm."""
    if isinstance(outputs, (tuple, list)):
        loss = _scalar(outputs[0])
        overflow = bool(np.any(outputs[1].asnumpy() if isinstance(outputs[1], Tensor) else outputs[1])) \
            if len(outputs) >= 2 else False
        norm = _scalar(outputs[4]) if len(outputs) >= 5 else math.nan
        return loss, overflow, norm
    return _scalar(outputs), False, math.nan
