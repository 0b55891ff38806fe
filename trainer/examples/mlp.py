"""trainerd's built-in example job: a small MLP classifier trained data-parallel on synthetic data.

    python -m trainer.examples.mlp --steps 200 --output /tmp/mlp     # by hand: one standalone process

Under trainerd the agent runs this same command once for the scheduler and once per device, each
with the environment `RankContext` reads; every rank takes its own part of each global batch.

Copy this file to start your own job. Keep the skeleton: read the rank context, call
`communication.initialize` before anything else (the scheduler process stops there), build the
model and data, resume from the launcher's checkpoint, run the custom train step, report progress
and let the checkpoints see every step, report `finished` and return 0. Replace the parts marked
YOUR MODEL and YOUR DATA.

Determinism: the samples of a step depend on --seed and their position in the sample stream only
(not on the world size), every rank builds the same initial weights from --seed, and every rank
applies the same all-reduced gradients; so the ranks hold identical weights, and a rerun with the
same seed and global batch reproduces them.

Checkpoints and resume (`trainer.runtime.checkpointing`): the launcher's TRAINERD_CHECKPOINT_DIR and
TRAINERD_CHECKPOINT_EVERY, or by hand --checkpoint-dir and --checkpoint-every (giving both with
different values is refused: the launcher's plan must hold); a checkpoint is also saved at the step
the agent's control file asks for. With TRAINERD_RESUME_FROM the run continues with the step after
the checkpoint's, at its consumed sample count, at any world size; a resume at the same world size
ends bit-identical to a run that was never interrupted. Exit status 2 with one line for a usage
error (including a checkpoint of another --seed), 65 for a checkpoint that cannot be loaded.

Bad batches: each step reads the next global batch of the sample stream (`trainer.data.sampler`),
leaving out the skip ledger's ranges (TRAINERD_SKIPS_FILE). The update is guarded inside the step
(`trainer.runtime.guard`): a non-finite loss or gradient norm, or a norm spike, keeps it out on every
rank, and the step is computed again before anything is blamed (`trainer.runtime.step_replay`): bad
data is skipped (rank 0 reports the step's sample range and later checkpoints record it), a device
fault keeps the replay's result, a healthy excursion of the norm is applied. For tests and demos,
--bad-samples, --spike-samples and --crash-samples make the samples at those stream positions NaN,
20 times too large, or fatal to the worker that reads them, and --corrupt-grad RANK:STEP corrupts one
rank's gradients once, as a flaky device would (`trainer.examples.faults`). --slow-start and --min-step-ms
shape a run's timing for tests (`trainer.examples.slow_start`, `trainer.examples.step_floor`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from proto.exit_codes import EXIT_OK, EXIT_USAGE
from proto.launch_env import (
    CHECKPOINT_DIR_ENV,
    CHECKPOINT_EVERY_ENV,
    GLOBAL_BATCH_ENV,
    MICRO_BATCH_ENV,
    SKIPS_FILE_ENV,
)
from proto.progress_datagram import WorkerEvent
from trainer.data.sampler import SampleStream, rank_share
from trainer.data.skip_ranges import SkipRanges
from trainer.examples.faults import GradientCorruption, WithGradientFault
from trainer.examples.final_weights import save_weights
from trainer.examples.slow_start import slow_start
from trainer.examples.step_floor import min_step_ms, pad_step
from trainer.runtime import communication
from trainer.runtime.checkpointing import ResumeError, TrainingCheckpoints
from trainer.runtime.communication import CommunicationError
from trainer.runtime.guard import GuardedApplyGradients, StepGuard, attempt_input, mean_over_ranks
from trainer.runtime.guard_policy import GuardSettings
from trainer.runtime.progress import ProgressReporter, StepPace
from trainer.runtime.rank_context import BatchSettings, RankCheckpointSettings, RankContext, RankContextError
from trainer.runtime.step_replay import Attempt, AttemptKind, StepJudge, StepOutcome
from trainer.runtime.training_run import settle_outcome

log = logging.getLogger("trainer.examples.mlp")

FEATURES, HIDDEN, CLASSES = 64, 256, 10
DATASET_SIZE = 16384
DEFAULT_GLOBAL_BATCH = 64
MAX_GRAD_NORM = 5.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.examples.mlp", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps to run")
    parser.add_argument("--bad-samples", type=sample_ranges, default=(), metavar="A:B[,C:D...]",
                        help="test data: samples at these stream positions are NaN (a bad batch the guard skips)")
    parser.add_argument("--spike-samples", type=sample_ranges, default=(), metavar="A:B[,C:D...]",
                        help="test data: samples at these stream positions are scaled by 20 (a gradient spike)")
    parser.add_argument("--crash-samples", type=sample_ranges, default=(), metavar="A:B[,C:D...]",
                        help="test data: a worker reading a sample at these stream positions is killed (SIGKILL)")
    parser.add_argument("--corrupt-grad", type=GradientCorruption.parse, metavar="RANK:STEP",
                        help="test fault: rank RANK's gradients of step STEP are multiplied by 1e4, once, in the "
                        "first generation (a flaky device)")
    parser.add_argument("--global-batch", type=int, help=f"samples per optimizer step over all ranks "
                        f"(default: {GLOBAL_BATCH_ENV}, else {DEFAULT_GLOBAL_BATCH})")
    parser.add_argument("--micro-batch", type=int, help="samples per forward pass on one rank "
                        f"(default: {MICRO_BATCH_ENV}, else global batch / world size)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the data, its order and the initial weights")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    parser.add_argument("--output", type=Path, help="directory where rank r writes final_rank{r}.npz")
    parser.add_argument("--checkpoint-dir", type=Path, help="where checkpoints go (default: "
                        f"{CHECKPOINT_DIR_ENV}, else none)")
    parser.add_argument("--checkpoint-every", type=int, help="save after every N-th step, 0: only when the "
                        f"control file asks (default: {CHECKPOINT_EVERY_ENV}, else 0)")
    parser.add_argument("--device-target", default="CPU", choices=communication.DEVICE_TARGETS)
    parser.add_argument("--slow-start", type=slow_start, metavar="RANK:SECONDS",
                        help="test timing: this rank sleeps before its first step, in the first generation only")
    parser.add_argument("--min-step-ms", type=min_step_ms, default=0.0, metavar="MS",
                        help="test timing: every step lasts at least MS milliseconds, the rest asleep, as a "
                             "larger model's would (default 0)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.checkpoint_every is not None and args.checkpoint_every < 0:
        parser.error("--checkpoint-every must be at least 0")
    return args


def batch_settings(args: argparse.Namespace, ctx: RankContext) -> BatchSettings:
    """The launcher's split when it set one (it keeps the global batch constant across world sizes), else the flags'."""
    if ctx.batch is not None:
        for flag, given, launcher in (("--global-batch", args.global_batch, ctx.batch.global_batch),
                                      ("--micro-batch", args.micro_batch, ctx.batch.micro_batch)):
            if given is not None and given != launcher:
                raise ValueError(f"{flag} {given} disagrees with the launcher's {launcher}")
        return ctx.batch
    global_batch = args.global_batch or DEFAULT_GLOBAL_BATCH
    return BatchSettings.for_world(global_batch, args.micro_batch or global_batch // ctx.world_size, ctx.world_size)


def sample_ranges(text: str) -> tuple[tuple[int, int], ...]:
    """`A:B,C:D` as half-open ranges of sample positions."""
    try:
        return SkipRanges.of(tuple(int(n) for n in part.split(":", 1)) for part in text.split(",")).ranges
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not A:B[,C:D...] with 0 <= A < B ({exc})") from None


def checkpoint_settings(args: argparse.Namespace, ctx: RankContext) -> RankCheckpointSettings:
    """The launcher's checkpoint settings, completed by the flags where it set none; a flag that
    contradicts a value the launcher set is refused, like the batch flags."""
    settings = ctx.checkpoints
    directory = None if args.checkpoint_dir is None else Path(os.path.abspath(args.checkpoint_dir))
    for flag, given, launcher in (("--checkpoint-dir", directory, settings.directory),
                                  ("--checkpoint-every", args.checkpoint_every, settings.every)):
        if given is not None and launcher is not None and given != launcher:
            raise ValueError(f"{flag} {given} disagrees with the launcher's {launcher}")
    return replace(settings, directory=settings.directory or directory,
                   every=args.checkpoint_every if settings.every is None else settings.every)


# ---------------------------------------------------------------- YOUR DATA

def synthetic_dataset(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random features labelled by a random linear teacher, so that there is something to learn."""
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((DATASET_SIZE, FEATURES), dtype=np.float32)
    teacher = rng.standard_normal((FEATURES, CLASSES), dtype=np.float32)
    return features, np.argmax(features @ teacher, axis=1).astype(np.int32)


def in_ranges(positions: np.ndarray, ranges: tuple[tuple[int, int], ...]) -> np.ndarray:
    """Which of `positions` fall in any of the half-open `ranges`."""
    mask = np.zeros(positions.shape, dtype=bool)
    for start, end in ranges:
        mask |= (positions >= start) & (positions < end)
    return mask


def step_batch(args: argparse.Namespace, features: np.ndarray, labels: np.ndarray,
               positions: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """This rank's samples, with the test data's injected faults (--bad/--spike/--crash-samples)."""
    x, y = features[indices], labels[indices]
    if args.crash_samples and in_ranges(positions, args.crash_samples).any():
        log.error("read a --crash-samples position: killing this worker")
        os.kill(os.getpid(), signal.SIGKILL)
    if args.bad_samples:
        x[in_ranges(positions, args.bad_samples)] = np.nan
    if args.spike_samples:
        x[in_ranges(positions, args.spike_samples)] *= 20.0
    return x, y


# ---------------------------------------------------------------- YOUR MODEL

class MLP(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Dense(FEATURES, HIDDEN, activation="relu")
        self.out = nn.Dense(HIDDEN, CLASSES)

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        return self.out(self.hidden(x))


# ---------------------------------------------------------------- the train step

class AccumulateGradients(nn.Cell):
    """Forward and backward of one micro batch: adds its gradients into `grad_sums`, returns its loss."""

    def __init__(self, network: nn.Cell, weights: ms.ParameterTuple, grad_sums: ms.ParameterTuple) -> None:
        super().__init__(auto_prefix=False)
        self.network = network
        self.loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        self.grad_sums = grad_sums
        self.grad_fn = ms.value_and_grad(self.forward, None, weights)

    def forward(self, x: ms.Tensor, y: ms.Tensor) -> ms.Tensor:
        return self.loss_fn(self.network(x), y)

    def construct(self, x: ms.Tensor, y: ms.Tensor) -> ms.Tensor:
        loss, grads = self.grad_fn(x, y)
        for grad_sum, grad in zip(self.grad_sums, grads):
            ops.assign_add(grad_sum, grad)
        return loss


class TrainStep:
    """One optimizer step: `grad_accum` micro batches on this rank, then one all-reduced, guarded update,
    computed again when the guard refuses it (`trainer.runtime.step_replay`).

    Two compiled graphs; the number of micro batches, which changes with the world size, is an input
    rather than a constant baked into them. The update is judged inside the second graph
    (`trainer.runtime.guard`): a non-finite loss or gradient norm, or a norm spike, keeps it out on
    every rank alike. If you enable MindSpore's compile cache (MS_COMPILER_CACHE_ENABLE), give each
    world size and batch split its own MS_COMPILER_CACHE_PATH: MindSpore 2.10 hands back a cached
    graph without checking input shapes or baked-in constants.
    """

    def __init__(self, network: nn.Cell, optimizer: nn.Optimizer, reducer: nn.Cell, loss_reducer: nn.Cell,
                 guard: StepGuard, grad_accum: int) -> None:
        grad_sums = optimizer.parameters.clone(prefix="grad_sum", init="zeros")
        self._accumulate = AccumulateGradients(network, optimizer.parameters, grad_sums)
        self._apply = GuardedApplyGradients(optimizer, grad_sums, reducer, loss_reducer, guard,
                                            max_grad_norm=MAX_GRAD_NORM)
        self._micro_batches = ms.Tensor(grad_accum, ms.float32)
        self._judge = StepJudge(guard.settings, guard.state, guard.rebaseline)

    def __call__(self, features: np.ndarray, labels: np.ndarray) -> StepOutcome:
        """Run one step on this rank's (grad_accum, micro_batch, ...) share: what became of it, with the
        global mean loss and gradient norm of the attempt that stands."""
        batch = [(ms.Tensor(x), ms.Tensor(y)) for x, y in zip(features, labels)]

        def attempt(kind: AttemptKind) -> Attempt:
            losses = [self._accumulate(x, y) for x, y in batch]
            loss, norm, accepted, local_norm = self._apply(attempt_input(kind), self._micro_batches, *losses)
            return Attempt(float(loss.asnumpy()), float(norm.asnumpy()), bool(accepted.asnumpy()),
                           float(local_norm.asnumpy()))

        return self._judge.run(attempt)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        ctx = RankContext.from_environ()
        batch = batch_settings(args, ctx)
        checkpoint_plan = checkpoint_settings(args, ctx)
        guard_settings = GuardSettings.from_environ()
        skips_file = os.environ.get(SKIPS_FILE_ENV)
        ledger = SkipRanges.read(skips_file) if skips_file else SkipRanges()
        communication.initialize(ctx, args.device_target)  # the scheduler process never returns from here
    except (RankContextError, CommunicationError, ValueError) as exc:
        print(f"mlp: {exc}", file=sys.stderr)
        return EXIT_USAGE
    rank = ctx.rank
    if rank is None:  # unreachable: communication.initialize keeps the scheduler process
        raise RuntimeError("the scheduler process has no rank and trains nothing")
    where = f"job {ctx.job} generation {ctx.generation} rank {ctx.rank}/{ctx.world_size}"

    ms.set_seed(args.seed)  # the same seed on every rank: identical initial weights
    features, labels = synthetic_dataset(args.seed)
    stream = SampleStream(DATASET_SIZE, args.seed, ledger)
    network = MLP()
    faulty = WithGradientFault(network) if args.corrupt_grad is not None else None
    optimizer = nn.Adam(network.trainable_params(), learning_rate=args.lr)
    guard = StepGuard(guard_settings)
    train_step = TrainStep(faulty or network, optimizer, communication.gradient_reducer(ctx, optimizer.parameters),
                           mean_over_ranks(ctx.world_size), guard, batch.grad_accum)

    with ProgressReporter.for_rank(ctx) as reporter:
        try:
            checkpoints = TrainingCheckpoints(ctx, checkpoint_plan, reporter, (faulty or network, optimizer, guard),
                                              data_seed=args.seed, grad_accumulation=batch.grad_accum,
                                              skip_ledger=ledger.ranges)
            start = checkpoints.resume()
        except ValueError as exc:
            print(f"mlp: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except ResumeError as exc:
            print(f"mlp: {exc}", file=sys.stderr)
            return exc.exit_code
        reporter.event(WorkerEvent.STARTED, step=start.step)
        log.info("%s: training steps %d to %d, global batch %d = micro batch %d × %d accumulation × %d ranks",
                 where, start.step + 1, args.steps, batch.global_batch, batch.micro_batch, batch.grad_accum,
                 ctx.world_size)
        consumed = start.consumed_samples
        pace = StepPace()
        if args.slow_start is not None:
            args.slow_start.wait_before_first_step(ctx)
        with checkpoints:
            for step in range(start.step + 1, args.steps + 1):
                began = time.perf_counter()
                positions, next_consumed = stream.step_positions(consumed, batch.global_batch)
                share = rank_share(positions, rank, ctx.world_size, batch.micro_batch)
                x, y = step_batch(args, features, labels, share, stream.indices(share))
                if faulty is not None and args.corrupt_grad.strikes(rank, ctx.generation, step):
                    faulty.fault.arm()
                started = time.perf_counter()
                outcome = train_step(x, y)
                elapsed = time.perf_counter() - started
                loss, grad_norm = outcome.standing.loss, outcome.standing.norm
                settle_outcome(reporter, checkpoints, where, rank, step, (int(positions[0]), next_consumed), outcome)
                consumed = next_consumed
                pad_step(began, args.min_step_ms)
                reporter.step(step, loss, grad_norm, pace.step_ended(batch.global_batch, began), consumed)
                checkpoints.after_step(step, consumed)
                if step == start.step + 1 or step == args.steps:
                    log.info("%s: step %d loss %.4f grad norm %.3f (%.2f s)", where, step, loss, grad_norm, elapsed)
        if args.output is not None:
            save_weights(network, args.output / f"final_rank{ctx.rank}.npz")
        reporter.event(WorkerEvent.FINISHED, step=max(args.steps, start.step))
        if reporter.dropped:
            log.warning("%s: %d of %d progress reports were dropped", where, reporter.dropped,
                        reporter.dropped + reporter.sent)
    log.info("%s: finished", where)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
