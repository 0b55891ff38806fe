"""What the bad-batch guard costs a training step: the example job's step with the guard on and off.

    /work/main/.venv/bin/python bench/guard.py                      # 40 rounds × 50 steps of each
    /work/main/.venv/bin/python bench/guard.py --micro-batch 32     # 2 micro batches per step

Both steps train the example job's model (`trainer.examples.mlp.MLP`, 64→256→10, Adam) in GRAPH mode on
one CPU process, on the same global batch (64 samples of the example's synthetic data, every step), with
the example's forward/backward (`AccumulateGradients`) and `trainer.runtime.guard.GuardedApplyGradients`
clipping at 5.0:

    off   guard=None: skips only a non-finite gradient norm, as the example job's step did before issue 6
    on    StepGuard with the defaults (spike factor 3.0, warm-up 10 steps): also checks the global mean
          loss and norm spikes and keeps the running mean in Parameters

A step is timed from its first micro batch to the host holding its loss, norm and reason (as the job's
loop needs them for its report). The two run in the same process, interleaved: rounds of N steps of one,
then N of the other, the first of each pair alternating, after both are compiled and warmed up; so load
from other processes on this shared machine hits both alike. Printed: median and quartiles of the step
times, of the apply phase alone, and how many steps the guard skipped (a skipped step does less work;
with this batch there should be none after the warm-up); then the overhead of `on` over `off` in percent,
from the overall medians and round by round (the median over rounds of the two adjacent blocks' medians,
which load drifting between rounds does not bias).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mindspore as ms
from mindspore import nn

from trainer.examples.mlp import MLP, AccumulateGradients, synthetic_dataset
from trainer.runtime.guard import GuardedApplyGradients, StepGuard, mean_over_ranks
from trainer.runtime.guard_policy import GuardSettings, skip_reason

MAX_GRAD_NORM = 5.0
LEARNING_RATE = 3e-3


class Step:
    """One variant of the example's train step, with its own copy of the model (same initial weights)."""

    def __init__(self, guarded: bool, grad_accum: int) -> None:
        ms.set_seed(0)
        self.network = MLP()
        self.optimizer = nn.Adam(self.network.trainable_params(), learning_rate=LEARNING_RATE)
        grad_sums = self.optimizer.parameters.clone(prefix="grad_sum", init="zeros")
        self.accumulate = AccumulateGradients(self.network, self.optimizer.parameters, grad_sums)
        self.apply = GuardedApplyGradients(self.optimizer, grad_sums, nn.Identity(), mean_over_ranks(1),
                                           StepGuard(GuardSettings()) if guarded else None, MAX_GRAD_NORM)
        self.micro_batches = ms.Tensor(grad_accum, ms.float32)
        self.step_s: list[float] = []
        self.apply_s: list[float] = []
        self.skipped = 0

    def __call__(self, features: list[ms.Tensor], labels: list[ms.Tensor], record: bool = True) -> None:
        started = time.perf_counter()
        losses = [self.accumulate(x, y) for x, y in zip(features, labels)]
        applying = time.perf_counter()
        loss, norm, accepted = self.apply(self.micro_batches, *losses)
        loss, norm = float(loss.asnumpy()), float(norm.asnumpy())
        reason = skip_reason(bool(accepted.asnumpy()), loss, norm)
        done = time.perf_counter()
        if record:
            self.step_s.append(done - started)
            self.apply_s.append(done - applying)
            self.skipped += reason is not None


def quartiles(samples: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(samples, n=4)
    return q1 * 1e3, median * 1e3, q3 * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps-per-round", type=int, default=50)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=64)
    args = parser.parse_args()
    if args.global_batch % args.micro_batch:
        parser.error("the global batch must be a multiple of the micro batch")
    grad_accum = args.global_batch // args.micro_batch

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    data, targets = synthetic_dataset(0)
    features = [ms.Tensor(x) for x in data[:args.global_batch].reshape(grad_accum, args.micro_batch, -1)]
    labels = [ms.Tensor(y) for y in targets[:args.global_batch].reshape(grad_accum, args.micro_batch)]
    steps = {"off": Step(False, grad_accum), "on": Step(True, grad_accum)}
    for step in steps.values():  # compile, and pass the guard's warm-up
        for _ in range(20):
            step(features, labels, record=False)

    print(f"MindSpore {ms.__version__}, GRAPH mode, CPU; {os.cpu_count()} cores (shared); "
          f"global batch {args.global_batch} = {grad_accum} × micro batch {args.micro_batch}; "
          f"{args.rounds} rounds × {args.steps_per_round} steps of each, interleaved", flush=True)
    paired = []  # per round: (median step of `on` − median step of `off`) / the latter, both in that round
    for round_ in range(args.rounds):
        order = ("off", "on") if round_ % 2 == 0 else ("on", "off")
        for name in order:
            for _ in range(args.steps_per_round):
                steps[name](features, labels)
        off_round, on_round = (statistics.median(steps[name].step_s[-args.steps_per_round:]) for name in ("off", "on"))
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
          f"round by round {p_med:+.2f}% (quartiles {p_q1:+.2f}% … {p_q3:+.2f}%); target < 2%")


if __name__ == "__main__":
    main()
