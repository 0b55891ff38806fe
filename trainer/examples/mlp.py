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
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from trainer.progress_channel import WorkerEvent
from trainer.runtime import communication
from trainer.runtime.checkpointing import ResumeError, TrainingCheckpoints
from trainer.runtime.communication import CommunicationError
from trainer.runtime.exit_codes import EXIT_OK, EXIT_USAGE
from trainer.runtime.progress import ProgressReporter
from trainer.runtime.rank_context import BatchSettings, CheckpointSettings, RankContext, RankContextError

log = logging.getLogger("trainer.examples.mlp")

FEATURES, HIDDEN, CLASSES = 64, 256, 10
DATASET_SIZE = 16384
DEFAULT_GLOBAL_BATCH = 64
MAX_GRAD_NORM = 5.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.examples.mlp", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps to run")
    parser.add_argument("--global-batch", type=int, help=f"samples per optimizer step over all ranks "
                        f"(default: TRAINERD_GLOBAL_BATCH, else {DEFAULT_GLOBAL_BATCH})")
    parser.add_argument("--micro-batch", type=int, help="samples per forward pass on one rank "
                        "(default: TRAINERD_MICRO_BATCH, else global batch / world size)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the data, its order and the initial weights")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    parser.add_argument("--output", type=Path, help="directory where rank r writes final_rank{r}.npz")
    parser.add_argument("--checkpoint-dir", type=Path, help="where checkpoints go (default: "
                        "TRAINERD_CHECKPOINT_DIR, else none)")
    parser.add_argument("--checkpoint-every", type=int, help="save after every N-th step, 0: only when the "
                        "control file asks (default: TRAINERD_CHECKPOINT_EVERY, else 0)")
    parser.add_argument("--device-target", default="CPU", choices=communication.DEVICE_TARGETS)
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


def checkpoint_settings(args: argparse.Namespace, ctx: RankContext) -> CheckpointSettings:
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


def stream_indices(start: int, count: int, seed: int) -> np.ndarray:
    """Dataset indices at positions [start, start + count) of the sample stream: epoch after epoch of
    seeded shuffles.

    A function of the seed and the positions only, never of the world size, so a job resumed at any
    size from a checkpoint's consumed sample count continues the same sample order.
    """
    positions = np.arange(start, start + count)
    epochs = positions // DATASET_SIZE
    indices = np.empty_like(positions)
    for epoch in np.unique(epochs):
        in_epoch = epochs == epoch
        order = np.random.default_rng([seed, epoch]).permutation(DATASET_SIZE)
        indices[in_epoch] = order[positions[in_epoch] % DATASET_SIZE]
    return indices


def rank_share(indices: np.ndarray, rank: int, batch: BatchSettings) -> np.ndarray:
    """This rank's contiguous part of a global batch, shaped (grad_accum, micro_batch)."""
    share = indices[rank * batch.per_rank:(rank + 1) * batch.per_rank]
    return share.reshape(batch.grad_accum, batch.micro_batch)


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


class ApplyGradients(nn.Cell):
    """Average the summed gradients over micro batches and ranks, clip them, update, clear the sums.

    The update is skipped when the gradient norm is not finite, here inside the graph: a callback
    would see the NaN only after the weights were spoiled. Returns the norm before clipping.
    """

    def __init__(self, optimizer: nn.Optimizer, grad_sums: ms.ParameterTuple, reducer: nn.Cell) -> None:
        super().__init__(auto_prefix=False)
        self.optimizer = optimizer
        self.grad_sums = grad_sums
        self.reducer = reducer

    def construct(self, micro_batches: ms.Tensor) -> ms.Tensor:
        grads = self.reducer(tuple([grad_sum / micro_batches for grad_sum in self.grad_sums]))
        norm = ops.sqrt(ops.addn([ops.reduce_sum(ops.square(grad)) for grad in grads]))
        if ops.isfinite(norm):
            scale = MAX_GRAD_NORM / ops.maximum(norm, MAX_GRAD_NORM)
            self.optimizer(tuple([grad * scale for grad in grads]))
        for grad_sum in self.grad_sums:
            ops.assign(grad_sum, ops.zeros_like(grad_sum))
        return norm


class TrainStep:
    """One optimizer step: `grad_accum` micro batches on this rank, then one all-reduced update.

    Two compiled graphs; the number of micro batches, which changes with the world size, is an input
    rather than a constant baked into them. If you enable MindSpore's compile cache
    (MS_COMPILER_CACHE_ENABLE), give each world size and batch split its own MS_COMPILER_CACHE_PATH:
    MindSpore 2.10 hands back a cached graph without checking input shapes or baked-in constants.
    """

    def __init__(self, network: nn.Cell, optimizer: nn.Optimizer, reducer: nn.Cell, grad_accum: int) -> None:
        grad_sums = optimizer.parameters.clone(prefix="grad_sum", init="zeros")
        self._accumulate = AccumulateGradients(network, optimizer.parameters, grad_sums)
        self._apply = ApplyGradients(optimizer, grad_sums, reducer)
        self._micro_batches = ms.Tensor(grad_accum, ms.float32)

    def __call__(self, features: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
        """Run one step on this rank's (grad_accum, micro_batch, ...) share; return its mean loss and the norm."""
        losses = [self._accumulate(ms.Tensor(x), ms.Tensor(y)) for x, y in zip(features, labels)]
        grad_norm = self._apply(self._micro_batches)
        return float(np.mean([loss.asnumpy() for loss in losses])), float(grad_norm.asnumpy())


def save_weights(network: nn.Cell, path: Path) -> None:
    """Write every trainable parameter to an .npz file, atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        np.savez(f, **{param.name: param.asnumpy() for param in network.trainable_params()})
    os.replace(partial, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        ctx = RankContext.from_environ()
        batch = batch_settings(args, ctx)
        checkpoint_plan = checkpoint_settings(args, ctx)
        communication.initialize(ctx, args.device_target)  # the scheduler process never returns from here
    except (RankContextError, CommunicationError, ValueError) as exc:
        print(f"mlp: {exc}", file=sys.stderr)
        return EXIT_USAGE
    where = f"job {ctx.job} generation {ctx.generation} rank {ctx.rank}/{ctx.world_size}"

    ms.set_seed(args.seed)  # the same seed on every rank: identical initial weights
    features, labels = synthetic_dataset(args.seed)
    network = MLP()
    optimizer = nn.Adam(network.trainable_params(), learning_rate=args.lr)
    train_step = TrainStep(network, optimizer, communication.gradient_reducer(ctx, optimizer.parameters),
                           batch.grad_accum)

    with ProgressReporter.for_rank(ctx) as reporter:
        try:
            # skip_ledger: issue 6 (bad batches) will pass the ledger in force and leave its ranges out.
            checkpoints = TrainingCheckpoints(ctx, checkpoint_plan, reporter, (network, optimizer),
                                              data_seed=args.seed, grad_accumulation=batch.grad_accum)
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
        with checkpoints:
            for step in range(start.step + 1, args.steps + 1):
                indices = stream_indices(consumed, batch.global_batch, args.seed)
                share = rank_share(indices, ctx.rank, batch)
                started = time.perf_counter()
                loss, grad_norm = train_step(features[share], labels[share])
                elapsed = time.perf_counter() - started
                consumed += batch.global_batch
                reporter.step(step, loss, grad_norm, batch.global_batch / elapsed, consumed)
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
