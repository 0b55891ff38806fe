"""What the bad-batch guard costs a training step, and what it skips on a long run: the example job's step
with the guard on and off, then 20,000 steps of the example's data with the guard on; the same for the
Transformer example (`--example transformer`), whose overhead run also times a third cell, the plain one
computing the global gradient norm as well (what a job that clips or logs its norm pays anyway), so that the
guard's own share shows apart from the norm's.

    /work/main/.venv/bin/python bench/guard.py                      # 40 rounds × 50 steps of each, then the long run
    /work/main/.venv/bin/python bench/guard.py --micro-batch 32     # 2 micro batches per step
    /work/main/.venv/bin/python bench/guard.py --long-steps 0       # the overhead alone
    /work/main/.venv/bin/python bench/guard.py --example transformer --rounds 20 --long-steps 20000
    /work/main/.venv/bin/python bench/guard.py --example transformer --rounds 0     # its long run alone
    /work/main/.venv/bin/python bench/guard.py --judge RECORD       # other rules over a --record file, offline

Both steps train the example job's model (`trainer.examples.mlp.MLP`, 64→256→10, Adam) in GRAPH mode on
one CPU process, on the same global batch (64 samples of the example's synthetic data, every step), with
the example's forward/backward (`AccumulateGradients`) and `trainer.runtime.guard.GuardedApplyGradients`
clipping at 5.0:

    off   guard=None: skips only a non-finite gradient norm, as the example job's step did before issue 6
    on    StepGuard with the defaults (`GuardSettings()`: spike factor 12, z-score 8, ceiling 50, warm-up 10
          steps): also checks the global mean loss and norm spikes and keeps the running mean and variance
          of log(norm) in Parameters

A step is timed from its first micro batch to the host holding its loss, norm and reason (as the job's
loop needs them for its report). The two run in the same process, interleaved: rounds of N steps of one,
then N of the other, the first of each pair alternating, after both are compiled and warmed up; so load
from other processes on this shared machine hits both alike. Printed: median and quartiles of the step
times, of the apply phase alone, and how many steps the guard skipped (a skipped step does less work;
with this batch there should be none after the warm-up); then the overhead of `on` over `off` in percent,
from the overall medians and round by round (the median over rounds of the two adjacent blocks' medians,
which load drifting between rounds does not bias).

The long run trains a fresh model with the guard on as the example job does: each step reads the next
global batch of the example's sample stream (seed 0; 256 steps an epoch, so 20,000 steps are 78 epochs,
and the gradient norm falls by four orders of magnitude as the model fits the data). At known steps,
spread from the first tenth of the run to its end, a bad batch is injected, the kinds in turn: one
sample's features NaN or infinite (the example's --bad-samples), the gradients scaled to 20 times the
norm's current level (the median of the last 100 clean steps' norms, measured apart from the guard), or
every sample's features 20 times too large (the example's --spike-samples; late in training the model is
so sure of such inputs that their gradient vanishes, so nothing is required of the guard there). Printed:
the clean steps that were skipped (target 0), beside what the rule before this one (3 times the running
mean of the norm) would have skipped judging the same norms; the largest ratio of a clean step's norm to
the running geometric mean and its largest z-score, the margin to the limits; and for each kind of
injected batch how many were skipped (target: all of the first three kinds) and the ratio of their norms.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections import deque
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from proto.progress_datagram import BadBatchReason
from trainer.data.sampler import SampleStream
from trainer.examples import tiny_corpus, transformer_lm
from trainer.examples.mlp import DATASET_SIZE, MLP, AccumulateGradients, synthetic_dataset
from trainer.runtime.guard import GuardedApplyGradients, StepGuard, attempt_input, mean_over_ranks
from trainer.runtime.guard_policy import GuardSettings, GuardState, decide, skip_reason
from trainer.runtime.guarded_cell import GuardedTrainOneStepCell
from trainer.runtime.step_replay import AttemptKind

MAX_GRAD_NORM = 5.0
LEARNING_RATE = 3e-3
TRANSFORMER_TEXT = tiny_corpus.corpus_text(transformer_lm.CORPUS_CHARACTERS)
TRANSFORMER_VOCAB = tiny_corpus.vocabulary(TRANSFORMER_TEXT)


class Step:
    """One variant of the example's train step, with its own copy of the model (same initial weights)."""

    def __init__(self, guarded: bool, grad_accum: int) -> None:
        ms.set_seed(0)
        self.network = MLP()
        self.optimizer = nn.Adam(self.network.trainable_params(), learning_rate=LEARNING_RATE)
        self.grad_sums = self.optimizer.parameters.clone(prefix="grad_sum", init="zeros")
        self.accumulate = AccumulateGradients(self.network, self.optimizer.parameters, self.grad_sums)
        self.guard = StepGuard(GuardSettings()) if guarded else None
        self.apply = GuardedApplyGradients(self.optimizer, self.grad_sums, nn.Identity(), mean_over_ranks(1),
                                           self.guard, MAX_GRAD_NORM)
        self.micro_batches = ms.Tensor(grad_accum, ms.float32)
        self.step_s: list[float] = []
        self.apply_s: list[float] = []
        self.skipped = 0

    def __call__(self, features: list[ms.Tensor], labels: list[ms.Tensor], record: bool = True,
                 grad_norm: float | None = None) -> tuple[float, BadBatchReason | None]:
        """One step: its global gradient norm and skip reason. With `grad_norm` (not timed), the summed
        gradients are scaled so that the step's global norm is that."""
        started = time.perf_counter()
        losses = [self.accumulate(x, y) for x, y in zip(features, labels)]
        if grad_norm is not None:
            sums = [grad_sum.asnumpy().astype(np.float64) for grad_sum in self.grad_sums]
            scale = grad_norm * len(features) / math.sqrt(sum(float(np.sum(np.square(g))) for g in sums))
            for grad_sum, values in zip(self.grad_sums, sums):
                grad_sum.set_data(ms.Tensor((values * scale).astype(np.float32)))
        applying = time.perf_counter()
        loss, norm, accepted, _ = self.apply(attempt_input(AttemptKind.FIRST), self.micro_batches, *losses)
        loss, norm = float(loss.asnumpy()), float(norm.asnumpy())
        reason = skip_reason(bool(accepted.asnumpy()), loss, norm)
        done = time.perf_counter()
        if record:
            self.step_s.append(done - started)
            self.apply_s.append(done - applying)
            self.skipped += reason is not None
        return norm, reason


def quartiles(samples: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(samples, n=4)
    return q1 * 1e3, median * 1e3, q3 * 1e3


TRANSFORMER_BATCH = 16  # a rank's share of the demo's global batch of 48 on 3 ranks


class NormedTrainOneStepCell(nn.TrainOneStepCell):
    """`nn.TrainOneStepCell` that also computes the global gradient norm and returns it with the loss: what a
    job that clips or logs its gradient norm pays anyway, so the guard's own share of the overhead shows."""

    def construct(self, *inputs: ms.Tensor) -> tuple[ms.Tensor, ms.Tensor]:
        loss = self.network(*inputs)
        grads = self.grad(self.network, self.weights)(*inputs, ops.fill(loss.dtype, loss.shape, self.sens))
        grads = self.grad_reducer(grads)
        norm = ops.sqrt(ops.addn([ops.reduce_sum(ops.square(ops.cast(grad, ms.float32))) for grad in grads]))
        return ops.depend(loss, self.optimizer(grads)), norm


TRANSFORMER_CELLS = {  # the variants of the Transformer example's train cell the overhead run compares
    "off": "nn.TrainOneStepCell",
    "norm": "nn.TrainOneStepCell that also computes the global gradient norm",
    "on": "GuardedTrainOneStepCell (the example's, default settings)",
}


class TransformerStep:
    """The Transformer example's train cell in one of the TRANSFORMER_CELLS variants, each with its own copy of
    the model (same initial weights)."""

    def __init__(self, variant: str, total_steps: int) -> None:
        ms.set_seed(0)
        self.network = transformer_lm.TransformerLM(len(TRANSFORMER_VOCAB))
        loss = transformer_lm.MaskedLMLoss(self.network)
        optimizer = transformer_lm.adamw(self.network, transformer_lm.parse_args(["--steps", str(total_steps)]))
        cells = {"off": nn.TrainOneStepCell, "norm": NormedTrainOneStepCell,
                 "on": lambda loss, optimizer: GuardedTrainOneStepCell(loss, optimizer, grad_accum=1)}
        self.cell = cells[variant](loss, optimizer)
        self.guarded = variant == "on"
        self.step_s: list[float] = []
        self.skipped = 0

    def __call__(self, batch: tuple[ms.Tensor, ...], record: bool = True) -> tuple[float, BadBatchReason | None]:
        """One step: its loss and skip reason, timed until the host holds what the callback reads."""
        started = time.perf_counter()
        outputs = self.cell(*batch)
        if self.guarded:
            loss, norm, accepted = (float(t.asnumpy()) for t in outputs)
            reason = skip_reason(bool(accepted), loss, norm)
        else:
            values = [float(t.asnumpy()) for t in (outputs if isinstance(outputs, tuple) else (outputs,))]
            loss, reason = values[0], None
        if record:
            self.step_s.append(time.perf_counter() - started)
            self.skipped += reason is not None
        return loss, reason


def transformer_data() -> tuple[transformer_lm.CorpusWindows, SampleStream]:
    windows = transformer_lm.CorpusWindows(tiny_corpus.encode(TRANSFORMER_TEXT, TRANSFORMER_VOCAB),
                                           transformer_lm.SEQ_LEN)
    return windows, SampleStream(len(windows), 0)


def transformer_batch(windows: transformer_lm.CorpusWindows, indices: np.ndarray) -> tuple[ms.Tensor, ...]:
    samples = [windows[int(i)] for i in indices]
    return tuple(ms.Tensor(np.stack(column)) for column in zip(*samples))


def transformer_overhead(rounds: int, steps_per_round: int) -> None:
    windows, stream = transformer_data()
    batch = transformer_batch(windows, stream.indices(np.arange(TRANSFORMER_BATCH)))
    steps = {name: TransformerStep(name, 1000) for name in TRANSFORMER_CELLS}
    for step in steps.values():  # compile, and pass the guard's warm-up
        for _ in range(20):
            step(batch, record=False)
    print(f"Transformer example (trainer.examples.transformer_lm: {transformer_lm.LAYERS} layers, d_model "
          f"{transformer_lm.D_MODEL}, sequence {transformer_lm.SEQ_LEN}), batch {TRANSFORMER_BATCH}; {rounds} rounds "
          f"× {steps_per_round} steps of each, interleaved (the order rotating round by round):", flush=True)
    for name, what in TRANSFORMER_CELLS.items():
        print(f"  {name:<5} {what}")
    paired: dict[str, list[float]] = {"off": [], "norm": []}
    names = list(steps)
    for round_ in range(rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            for _ in range(steps_per_round):
                steps[name](batch)
        on_round = statistics.median(steps["on"].step_s[-steps_per_round:])
        for base in paired:
            base_round = statistics.median(steps[base].step_s[-steps_per_round:])
            paired[base].append((on_round - base_round) / base_round)
    print(f"\n{'cell':<6} {'step median':>12} {'q1':>8} {'q3':>8} {'steps':>6} {'skipped':>8}")
    for name, step in steps.items():
        q1, median, q3 = quartiles(step.step_s)
        print(f"{name:<6} {median:>9.3f} ms {q1:>8.3f} {q3:>8.3f} {len(step.step_s):>6} {step.skipped:>8}")
    on = statistics.median(steps["on"].step_s)
    for base in paired:
        base_s = statistics.median(steps[base].step_s)
        p_q1, p_med, p_q3 = (100 * q for q in statistics.quantiles(paired[base], n=4))
        print(f"overhead of the guard over {base!r}: {100 * (on - base_s) / base_s:+.2f}% of the step median "
              f"({(on - base_s) * 1e6:+.0f} µs); round by round {p_med:+.2f}% (quartiles {p_q1:+.2f}% … "
              f"{p_q3:+.2f}%)", flush=True)


def transformer_long_run(steps: int, global_batch: int, record: Path | None) -> None:
    """A fresh Transformer trained as the example does by hand (its sample stream, seed 0, its global batch in
    one process, warm-up then cosine over `steps`), guard on, nothing injected: every skip is a false positive.
    With `record`, each step's loss, norm and verdict go to that file (the form of
    tests/trainer/data/transformer_lm_3_ranks_norms.txt plus the verdict), to judge other rules offline."""
    windows, stream = transformer_data()
    step = TransformerStep("on", steps)
    guard = step.cell.guard
    print(f"\nTransformer long run: {steps} clean steps of the example's stream (seed 0, global batch "
          f"{global_batch}, one process) with the guard on ({guard.settings})", flush=True)
    started = time.perf_counter()
    consumed, losses, skipped = 0, {}, []
    ratios: dict[int, float] = {}
    zscores: dict[int, float] = {}
    recorded = record.open("w", buffering=1) if record is not None else None
    for n in range(1, steps + 1):
        positions, consumed = stream.step_positions(consumed, global_batch)
        mean, var = float(guard.log_norm_mean.asnumpy()), float(guard.log_norm_var.asnumpy())
        warm = int(guard.accepted_steps.asnumpy()) >= guard.settings.warmup_steps
        outputs = step.cell(*transformer_batch(windows, stream.indices(positions)))
        losses[n], norm, accepted = (float(t.asnumpy()) for t in outputs)
        if not accepted:
            skipped.append(n)
        if recorded is not None:
            recorded.write(f"{n} {losses[n]:.6g} {norm:.6g} {int(accepted)}\n")
        if warm and math.isfinite(norm) and norm > 0:
            ratios[n] = norm / math.exp(mean)
            if var > 0:
                zscores[n] = (math.log(norm) - mean) / math.sqrt(var)
        if n % 2000 == 0:
            print(f"  step {n}: loss {losses[n]:.3f}, {len(skipped)} skipped, {time.perf_counter() - started:.0f} s",
                  flush=True)
    shown = sorted({1, steps // 10, steps // 2, steps} - {0})
    print(f"  {time.perf_counter() - started:.0f} s; loss " + ", ".join(f"{losses[n]:.3f} at step {n}" for n in shown))
    listed = f": steps {steps_text(skipped)}" if skipped else ""
    print(f"  clean steps skipped: {len(skipped)} of {steps} (target 0){listed}", flush=True)
    for n in skipped:
        print(f"    step {n}: loss {losses[n]:.4f}, norm / running geometric mean {ratios.get(n, math.nan):.2f}, "
              f"z-score {zscores.get(n, math.nan):.2f}")
    if recorded is not None:
        recorded.close()
    print_margins(ratios, zscores, guard.settings)


def print_margins(ratios: dict[int, float], zscores: dict[int, float], settings: GuardSettings) -> None:
    """The clean steps' largest norm against the running geometric mean and largest z-score of log(norm),
    beside the limits of the rule: how far from a false skip the run came."""
    if not ratios or not zscores:
        return
    top_ratio = max(ratios, key=ratios.__getitem__)
    top_z = max(zscores, key=zscores.__getitem__)
    print(f"  clean steps' largest norm / running geometric mean: {ratios[top_ratio]:.2f} (step "
          f"{top_ratio}; never a spike up to {settings.spike_factor:g}, always above "
          f"{settings.spike_ceiling:g}); largest z-score of log(norm): {zscores[top_z]:.2f} (step "
          f"{top_z}; a spike above {settings.spike_zscore:g} between those)", flush=True)


JUDGED_SETTINGS = (GuardSettings(), GuardSettings(spike_factor=5.0), GuardSettings(spike_factor=3.0),
                   GuardSettings(spike_factor=3.0, spike_zscore=6.0))


def judge(record: Path) -> None:
    """The pure rule (`guard_policy.decide`) under the default and more sensitive settings, over the steps of
    a recorded run (`--record`'s lines or tests/trainer/data's: step, loss, norm[, verdict]): the clean
    steps each would have skipped. A skipped step leaves the rule's state as it was, as in the step."""
    rows = np.loadtxt(record, comments="#", ndmin=2)
    print(f"{record}: {len(rows)} steps, loss {rows[0, 1]:.4g} at step {int(rows[0, 0])} to {rows[-1, 1]:.4g} "
          f"at step {int(rows[-1, 0])}")
    for settings in JUDGED_SETTINGS:
        state, skipped = GuardState(), []
        for step, loss, norm in rows[:, :3]:
            reason, state = decide(settings, state, float(loss), float(norm))
            if reason is not None:
                skipped.append(int(step))
        listed = f": steps {steps_text(skipped)}" if skipped else ""
        print(f"  spike_factor {settings.spike_factor:g}, spike_zscore {settings.spike_zscore:g}, spike_ceiling "
              f"{settings.spike_ceiling:g}: {len(skipped)} skipped{listed}")


INJECTED = {  # what the long run injects, in turn, and whether the guard must skip it
    "nan": ("one sample's features NaN", True),
    "inf": ("one sample's features infinite", True),
    "x20": ("gradients scaled to 20 x the median norm of the last 100 clean steps", True),
    "x20 inputs": ("every sample's features x 20, the example's --spike-samples", False),
}


def injected_steps(steps: int, count: int) -> dict[int, str]:
    """`count` steps spread evenly from the first tenth of the run to its last step, the kinds in turn."""
    at = np.linspace(max(steps // 10, 1), steps, count).astype(int)
    return {int(step): list(INJECTED)[i % len(INJECTED)] for i, step in enumerate(at)}


def rule_before_skips(norms: dict[int, float]) -> list[int]:
    """The steps the rule before this one would have skipped judging these norms (in float64): after 10
    accepted steps, a norm above 3 times the running mean (the true mean of the first 100 accepted norms,
    then an exponential moving average with weight 1/100)."""
    mean, accepted, skipped = 0.0, 0, []
    for step, norm in norms.items():
        if not math.isfinite(norm) or (accepted >= 10 and norm > 3.0 * mean):
            skipped.append(step)
            continue
        accepted += 1
        mean += (norm - mean) / min(accepted, 100)
    return skipped


def steps_text(steps: list[int], limit: int = 20) -> str:
    return ", ".join(map(str, steps[:limit])) + (", ..." if len(steps) > limit else "")


def long_run(steps: int, injections: int, global_batch: int, micro_batch: int) -> None:
    grad_accum = global_batch // micro_batch
    data, targets = synthetic_dataset(0)
    stream = SampleStream(DATASET_SIZE, 0)
    step = Step(True, grad_accum)
    guard = step.guard
    assert guard is not None
    settings = guard.settings
    injected = injected_steps(steps, injections)
    print(f"\nlong run: {steps} steps of the example's data (seed 0, global batch {global_batch}) with the guard "
          f"on ({settings}); {len(injected)} of them injected", flush=True)
    norms: dict[int, float] = {}
    skipped: dict[int, BadBatchReason] = {}
    ratios: dict[int, float] = {}  # step -> its norm / the running geometric mean, after the warm-up
    zscores: dict[int, float] = {}  # step -> the z-score of log(norm), after the warm-up
    recent: deque[float] = deque(maxlen=100)  # the last clean steps' norms
    started = time.perf_counter()
    consumed = 0
    for n in range(1, steps + 1):
        positions, consumed = stream.step_positions(consumed, global_batch)
        indices = stream.indices(positions)
        x, y = data[indices], targets[indices]
        kind = injected.get(n)
        if kind == "nan":
            x[0] = np.nan
        elif kind == "inf":
            x[0] = np.inf
        elif kind == "x20 inputs":
            x = x * 20.0
        grad_norm = 20.0 * statistics.median(recent) if kind == "x20" else None
        mean, var = float(guard.log_norm_mean.asnumpy()), float(guard.log_norm_var.asnumpy())
        warm = int(guard.accepted_steps.asnumpy()) >= settings.warmup_steps
        norm, reason = step([ms.Tensor(part) for part in x.reshape(grad_accum, micro_batch, -1)],
                            [ms.Tensor(part) for part in y.reshape(grad_accum, micro_batch)], False, grad_norm)
        norms[n] = norm
        if reason is not None:
            skipped[n] = reason
        if kind is None:
            recent.append(norm)
        if warm and math.isfinite(norm):
            ratios[n] = norm / math.exp(mean)
            if norm > 0 and var > 0:
                zscores[n] = (math.log(norm) - mean) / math.sqrt(var)
    elapsed = time.perf_counter() - started

    clean = [n for n in norms if n not in injected]
    false_skips = sorted(n for n in skipped if n not in injected)
    before = [n for n in rule_before_skips(norms) if n not in injected]
    print(f"  {elapsed:.0f} s; clean steps' gradient norm " + ", ".join(
        f"{norms[n]:.3g} at step {n}" for n in (clean[0], clean[len(clean) // 2], clean[-1])))
    print(f"  clean steps skipped: {len(false_skips)} of {len(clean)} (target 0)"
          f"{': steps ' + steps_text(false_skips) if false_skips else ''}; the rule before (3 x the running mean) "
          f"would have skipped {len(before)}{': steps ' + steps_text(before) if before else ''}")
    print_margins({n: r for n, r in ratios.items() if n not in injected},
                  {n: z for n, z in zscores.items() if n not in injected}, settings)
    for kind, (what, must_skip) in INJECTED.items():
        at = [n for n, k in injected.items() if k == kind]
        if not at:
            continue
        caught = [n for n in at if n in skipped]
        reasons = ", ".join(sorted({str(skipped[n]) for n in caught})) or "none"
        verdict = ("" if len(caught) == len(at) else "; MISSED") if must_skip else "; nothing required"
        found = ", ".join(f"{ratios[n]:.3g}" if n in ratios else f"{norms[n]:.3g}" for n in at)
        print(f"  injected {kind} ({what}) at steps {steps_text(at)}: {len(caught)} of {len(at)} skipped "
              f"({reasons}){verdict}; norm / running geometric mean: {found}")


def mlp_overhead(rounds: int, steps_per_round: int, global_batch: int, micro_batch: int) -> None:
    grad_accum = global_batch // micro_batch
    data, targets = synthetic_dataset(0)
    features = [ms.Tensor(x) for x in data[:global_batch].reshape(grad_accum, micro_batch, -1)]
    labels = [ms.Tensor(y) for y in targets[:global_batch].reshape(grad_accum, micro_batch)]
    steps = {"off": Step(False, grad_accum), "on": Step(True, grad_accum)}
    for step in steps.values():  # compile, and pass the guard's warm-up
        for _ in range(20):
            step(features, labels, record=False)

    print(f"MindSpore {ms.__version__}, GRAPH mode, CPU; {os.cpu_count()} cores (shared); "
          f"global batch {global_batch} = {grad_accum} × micro batch {micro_batch}; "
          f"{rounds} rounds × {steps_per_round} steps of each, interleaved", flush=True)
    paired = []  # per round: (median step of `on` − median step of `off`) / the latter, both in that round
    for round_ in range(rounds):
        order = ("off", "on") if round_ % 2 == 0 else ("on", "off")
        for name in order:
            for _ in range(steps_per_round):
                steps[name](features, labels)
        off_round, on_round = (statistics.median(steps[name].step_s[-steps_per_round:]) for name in ("off", "on"))
        paired.append((on_round - off_round) / off_round)

    print(f"\n{'guard':<6} {'step median':>12} {'q1':>8} {'q3':>8} {'apply median':>13} {'q1':>8} {'q3':>8} "
          f"{'steps':>6} {'skipped':>8}")
    for name, step in steps.items():
        s_q1, s_med, s_q3 = quartiles(step.step_s)
        a_q1, a_med, a_q3 = quartiles(step.apply_s)
        print(f"{name:<6} {s_med:>9.3f} ms {s_q1:>8.3f} {s_q3:>8.3f} {a_med:>10.3f} ms {a_q1:>8.3f} {a_q3:>8.3f} "
              f"{len(step.step_s):>6} {step.skipped:>8}")
    off, on = (statistics.median(steps[name].step_s) for name in ("off", "on"))
    off_apply, on_apply = (statistics.median(steps[name].apply_s) for name in ("off", "on"))
    p_q1, p_med, p_q3 = (100 * q for q in statistics.quantiles(paired, n=4))
    print(f"\noverhead of the guard: {100 * (on - off) / off:+.2f}% of the step median "
          f"({(on - off) * 1e6:+.0f} µs; apply phase {(on_apply - off_apply) * 1e6:+.0f} µs); "
          f"round by round {p_med:+.2f}% (quartiles {p_q1:+.2f}% … {p_q3:+.2f}%); target < 2%", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40, help="rounds of the overhead run (0: none)")
    parser.add_argument("--steps-per-round", type=int, default=50)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--long-steps", type=int, default=20_000, help="steps of the long run (0: none)")
    parser.add_argument("--record", type=Path, help="the Transformer long run's steps go to this file")
    parser.add_argument("--injections", type=int, default=16, help="bad batches injected into the long run")
    parser.add_argument("--example", choices=("mlp", "transformer"), default="mlp",
                        help="whose step: the MLP's (trainer.examples.mlp) or the Transformer's (Model.train's cell)")
    parser.add_argument("--judge", type=Path, metavar="RECORD",
                        help="only judge a recorded run's steps by the rule under several settings (no training)")
    args = parser.parse_args()
    if args.judge is not None:
        try:
            judge(args.judge)
        except (OSError, ValueError, IndexError) as exc:
            parser.error(f"cannot judge {args.judge}: {exc}")
        return
    if args.global_batch % args.micro_batch:
        parser.error("the global batch must be a multiple of the micro batch")

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    if args.example == "transformer":
        print(f"MindSpore {ms.__version__}, GRAPH mode, CPU; {os.cpu_count()} cores (shared)", flush=True)
        if args.rounds:
            transformer_overhead(args.rounds, args.steps_per_round)
        if args.long_steps:
            transformer_long_run(args.long_steps, transformer_lm.DEFAULT_GLOBAL_BATCH, args.record)
        return
    if args.rounds:
        mlp_overhead(args.rounds, args.steps_per_round, args.global_batch, args.micro_batch)
    if args.long_steps:
        long_run(args.long_steps, args.injections, args.global_batch, args.micro_batch)


if __name__ == "__main__":
    main()
