"""What replay before blame (`trainer.runtime.step_replay`) makes of long clean runs and of injected faults,
through the examples' own train steps: the MLP's `TrainStep` and the Transformer's `GuardedTrainOneStepCell`,
with the guard's defaults.

    /work/main/.venv/bin/python bench/replay.py                                  # MLP: 30,000 steps, 32 = 2 x 16
    /work/main/.venv/bin/python bench/replay.py --global-batch 64 --micro-batch 32 --steps 20000
    /work/main/.venv/bin/python bench/replay.py --example transformer --steps 10000
    /work/main/.venv/bin/python bench/replay.py --clean-only                     # no fault run

One process. A W-rank run whose ranks take micro batches of m samples all-reduces the mean of W x a
micro-batch gradients; this process accumulates the same micro batches one after another (grad_accum =
global / micro), so the loss and norm the guard judges are those of the W-rank run (up to the order of the
float additions), and so are its statistics: `--global-batch 32 --micro-batch 16` is the issue's 2-rank run.

The clean run trains on the example's data to a loss near zero (the MLP: its synthetic classification, 512
steps an epoch at batch 32; the Transformer: its corpus) and counts the verdicts: ACCEPTED, EXCURSION (a
suspect step, replayed, applied), BAD_DATA (skipped: on clean data each one is a healthy batch lost),
REBASELINED, DEVICE_FAULT. Target: no BAD_DATA, no REBASELINED, no DEVICE_FAULT.

The fault run repeats the run with one fault every `steps / (kinds x rounds)` steps, the kinds in turn:
  nan         one sample's features (MLP) or loss mask (Transformer) NaN           -> BAD_DATA
  inf         the same, infinite                                                   -> BAD_DATA
  scrambled   every label of the batch drawn at random (Transformer: the targets)  -> BAD_DATA when it
              spikes the norm (a batch of random labels near the start of training does not stand out)
  spike20     every sample's features x20 (MLP) or loss mask x20 (Transformer)     -> BAD_DATA when its loss
              stands out of the loss's spread, EXCURSION (applied, clipped) when it does not
  device      the gradients of the step x1e4 once, as --corrupt-grad does          -> DEVICE_FAULT
and prints, for each kind, the verdicts it got.

Printed last: the share of steps replayed (what replay costs: one more step's compute each).
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable

import mindspore as ms
import numpy as np
from mindspore import nn

from trainer.data.sampler import SampleStream
from trainer.examples import mlp, tiny_corpus, transformer_lm
from trainer.examples.faults import WithGradientFault
from trainer.runtime.guard import StepGuard, mean_over_ranks
from trainer.runtime.guard_policy import GuardSettings
from trainer.runtime.guarded_cell import GuardedTrainOneStepCell
from trainer.runtime.step_replay import StepOutcome, Verdict

KINDS = ("nan", "inf", "scrambled", "spike20", "device")


class MLPRun:
    """The MLP example's step on its data, one process, with a GradientFault on the network's output."""

    def __init__(self, global_batch: int, micro_batch: int, seed: int = 0) -> None:
        ms.set_seed(seed)
        self.features, self.labels = mlp.synthetic_dataset(seed)
        self.stream = SampleStream(mlp.DATASET_SIZE, seed)
        self.network = WithGradientFault(mlp.MLP())
        optimizer = nn.Adam(self.network.network.trainable_params(), learning_rate=3e-3)
        self.step_fn = mlp.TrainStep(self.network, optimizer, nn.Identity(), mean_over_ranks(1),
                                     StepGuard(GuardSettings()), global_batch // micro_batch)
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.consumed = 0
        self.rng = np.random.default_rng(seed + 1)

    def step(self, fault: str | None) -> StepOutcome:
        positions, self.consumed = self.stream.step_positions(self.consumed, self.global_batch)
        indices = self.stream.indices(positions)
        x, y = self.features[indices].copy(), self.labels[indices].copy()
        if fault == "nan":
            x[0] = np.nan
        elif fault == "inf":
            x[0] = np.inf
        elif fault == "scrambled":
            y = self.rng.integers(0, mlp.CLASSES, y.shape).astype(np.int32)
        elif fault == "spike20":
            x *= 20.0
        elif fault == "device":
            self.network.fault.arm()
        shape = (self.global_batch // self.micro_batch, self.micro_batch)
        return self.step_fn(x.reshape(*shape, -1), y.reshape(shape))


class TransformerRun:
    """The Transformer example's GuardedTrainOneStepCell on its corpus, one process."""

    def __init__(self, global_batch: int, micro_batch: int, total_steps: int, seed: int = 0) -> None:
        ms.set_seed(seed)
        text = tiny_corpus.corpus_text(transformer_lm.CORPUS_CHARACTERS)
        vocab = tiny_corpus.vocabulary(text)
        self.windows = transformer_lm.CorpusWindows(tiny_corpus.encode(text, vocab), transformer_lm.SEQ_LEN)
        self.vocab_size = len(vocab)
        self.stream = SampleStream(len(self.windows), seed)
        network = transformer_lm.TransformerLM(len(vocab))
        self.faulty = WithGradientFault(network)
        args = transformer_lm.parse_args(["--steps", str(total_steps), "--steps-per-epoch", str(total_steps)])
        self.cell = GuardedTrainOneStepCell(transformer_lm.MaskedLMLoss(self.faulty),
                                            transformer_lm.adamw(network, args),
                                            grad_accum=global_batch // micro_batch, environ={})
        self.global_batch = global_batch
        self.consumed = 0
        self.rng = np.random.default_rng(seed + 1)

    def step(self, fault: str | None) -> StepOutcome:
        positions, self.consumed = self.stream.step_positions(self.consumed, self.global_batch)
        samples = [self.windows[int(i)] for i in self.stream.indices(positions)]
        tokens, targets, mask = (np.stack(column) for column in zip(*samples))
        if fault == "nan":
            mask[0] = np.nan
        elif fault == "inf":
            mask[0] = np.inf
        elif fault == "scrambled":
            targets = self.rng.integers(0, self.vocab_size, targets.shape).astype(targets.dtype)
        elif fault == "spike20":
            mask = mask * 20.0
        elif fault == "device":
            self.faulty.fault.arm(passes=2)  # GuardedTrainOneStepCell runs the network twice per micro batch
        self.cell(ms.Tensor(tokens), ms.Tensor(targets), ms.Tensor(mask))
        assert self.cell.last_outcome is not None
        return self.cell.last_outcome


def run(make: Callable[[], MLPRun | TransformerRun], steps: int, faults: dict[int, str]) -> tuple[
        collections.Counter, dict[str, collections.Counter], list[float], float]:
    training = make()
    verdicts: collections.Counter = collections.Counter()
    by_kind: dict[str, collections.Counter] = {kind: collections.Counter() for kind in KINDS}
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(1, steps + 1):
        fault = faults.get(step)
        outcome = training.step(fault)
        verdicts[outcome.verdict] += 1
        if fault is not None:
            by_kind[fault][outcome.verdict] += 1
        losses.append(outcome.standing.loss)
    return verdicts, by_kind, losses, time.perf_counter() - started


def shown(counter: collections.Counter) -> str:
    return ", ".join(f"{verdict.value} {counter[verdict]}" for verdict in Verdict if counter[verdict]) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--example", choices=("mlp", "transformer"), default="mlp")
    parser.add_argument("--steps", type=int, default=30_000)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4, help="faults of each kind in the fault run")
    parser.add_argument("--clean-only", action="store_true")
    args = parser.parse_args()
    if args.global_batch % args.micro_batch:
        parser.error("--micro-batch must divide --global-batch")
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")

    def make() -> MLPRun | TransformerRun:
        if args.example == "mlp":
            return MLPRun(args.global_batch, args.micro_batch)
        return TransformerRun(args.global_batch, args.micro_batch, args.steps)

    print(f"{args.example}: {args.steps} steps, global batch {args.global_batch} in micro batches of "
          f"{args.micro_batch}, the guard's defaults ({GuardSettings()})", flush=True)
    verdicts, _, losses, elapsed = run(make, args.steps, {})
    tail = losses[-100:]
    print(f"  clean: {shown(verdicts)}  ({elapsed:.0f} s; loss of the last 100 steps: median "
          f"{np.median(tail):.3g}, max {max(tail):.3g})")
    replayed = args.steps - verdicts[Verdict.ACCEPTED]
    print(f"  clean: healthy steps skipped {verdicts[Verdict.BAD_DATA]}, re-baselines {verdicts[Verdict.REBASELINED]}, "
          f"device faults {verdicts[Verdict.DEVICE_FAULT]}; replayed {replayed} of {args.steps} "
          f"({100.0 * replayed / args.steps:.2f}%)", flush=True)
    if args.clean_only or args.rounds < 1:
        return
    spacing = args.steps // (len(KINDS) * args.rounds + 1)
    faults = {spacing * (i + 1): KINDS[i % len(KINDS)] for i in range(len(KINDS) * args.rounds)}
    verdicts, by_kind, _, elapsed = run(make, args.steps, faults)
    print(f"  faulted ({len(faults)} faults, one every {spacing} steps, from step {spacing}): {shown(verdicts)} "
          f"({elapsed:.0f} s)")
    for kind in KINDS:
        print(f"    {kind:<10} {shown(by_kind[kind])}")
    clean_verdicts = sum(verdicts[v] for v in (Verdict.BAD_DATA, Verdict.DEVICE_FAULT)) - sum(
        by_kind[k][v] for k in KINDS for v in (Verdict.BAD_DATA, Verdict.DEVICE_FAULT))
    print(f"    clean steps of the faulted run skipped or blamed on a device: {clean_verdicts}")


if __name__ == "__main__":
    main()
