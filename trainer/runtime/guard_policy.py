"""When an optimizer step is suspect, and what the guard remembers to judge it: the settings, the in-step
rule in plain Python, and the reason a skip is reported with. `trainer.runtime.guard` runs the same rule
inside the compiled step; this twin documents it and serves the tests. Pure: no MindSpore.

A suspect step is not yet a bad batch: `trainer.runtime.step_replay` computes it once more before anything
is blamed, and only a suspect step that comes out the same and raised the loss is skipped as bad data. This
module is the first half of that: the in-step check that keeps a suspect update out of the weights.

The in-step rule, for a step's global mean loss and the global norm of its all-reduced gradients (before
clipping), with the guard's state and delta = max(log(norm) - log_norm_mean, -log(spike_ceiling)):
1. the loss is not finite                                    -> refused, "nonfinite_loss"
2. else the norm is not finite                               -> refused, "nonfinite_grad_norm"
3. else after `warmup_steps` accepted steps, delta > limit   -> refused, "grad_norm_spike", unless the
       step is forced (a replay the judge has cleared: see step_replay), where
       limit = max(log(spike_factor), min(spike_zscore × sqrt(log_norm_var), log(spike_ceiling)))
4. else accepted: the optimizer updates, accepted_steps += 1, the norm's mean and var move by delta, and the
   loss's by max(log(loss) - log_loss_mean, -log(spike_ceiling)).
A refused step changes nothing: no weights, no optimizer state, no guard state.

In words: with the running geometric mean of the accepted norms g = exp(log_norm_mean) and the running
standard deviation of their logarithms sigma = sqrt(log_norm_var), a norm above spike_ceiling × g is always
suspect, one at most spike_factor × g never is, and in between it is when its logarithm lies more than
spike_zscore standard deviations above the mean. With the defaults (12, 8, 50) a steady norm is suspect above
12 × g, and one that swings widely (late in training) only as far out as its own spread says, up to 50 × g.
The ceiling was 12 when a suspect step was skipped outright; with the replay deciding, a suspect step costs
one more step's compute, and 12 made the converging MLP run below replay 4.4% of its steps (50: 1.1%). A
device fault of the size `--corrupt-grad` makes (10^4) stays far above it.

Why the norm alone is not the verdict: a healthy model's norm makes excursions of its own, and late in
training, when the loss nears zero, its norm falls by orders of magnitude while its relative swings grow.
A MLP run of 2 ranks (global batch 32, micro batch 16) converging to a loss of 0.0002-0.006 made excursions
above 12 × g hundreds of times a minute; the guard of before skipped each, a skipped step never moved its
statistics, and the skips cascaded (1,169 healthy ranges in the ledger, the job FAILED as bad data). So a
suspect step is a question, which step_replay answers with the replay and the loss; a cleared excursion is
applied (forced) and moves the statistics like any accepted step, so they follow the norm wherever it goes.

The loss statistics (log_loss_mean, log_loss_var) are kept the same way over the accepted steps, for the
judge: a reproduced spike is bad data only when its loss stands out from them (`loss_raised`). A bad batch
(scrambled labels, a corrupted record, inputs out of range) raises its own loss; the clean excursions seen
in `bench/guard.py`'s runs left it within the loss's usual spread.

The mean and var are the true mean and (population) variance of the clamped logarithms over the accepted
steps for the first `mean_horizon` of them, then exponential moving averages with weight 1 / mean_horizon
(Welford's update with the weight w = min(accepted_steps + 1, mean_horizon); delta - step is the new distance
to the mean):
    step = delta / w;  mean += step;  var += (delta × (delta - step) - var) / w
An average over all of history would go stale as training moves the norm; a plain EMA started at zero
would need a bias correction during warm-up; this form needs neither. delta is held to at least
-log(spike_ceiling): a zero norm or loss (log -inf), which is no bad batch, would otherwise drag the mean
down without limit. All arithmetic is float32, in this order, in both twins. The logarithm is the one thing
they do not share bit for bit: here it is the float32 rounding of the exact logarithm, in the step it is
MindSpore's CPU kernel, a last bit off for a few arguments in a thousand; so the twins' states agree to a few
ulps, and their decisions agree but for a norm within a few ulps of the limit. Every rank runs the same
kernel on the same all-reduced loss and norm, so the ranks always agree with each other.

MindFormers' bad-batch skipping (`use_skip_data_by_global_norm` with `monitor_config.global_norm_spike_threshold`)
skips the update above a fixed norm and stops training after a count of skips in a row; Megatron- and
OLMo-style runs roll back after a loss spike. None of them tells a bad batch from a bad device, which the
replay does.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from proto.launch_env import (
    LOSS_FACTOR_ENV,
    LOSS_ZSCORE_ENV,
    SPIKE_CEILING_ENV,
    SPIKE_FACTOR_ENV,
    SPIKE_WARMUP_STEPS_ENV,
    SPIKE_ZSCORE_ENV,
)
from proto.progress_datagram import BadBatchReason

NONFINITE_LOSS = BadBatchReason.NONFINITE_LOSS
NONFINITE_GRAD_NORM = BadBatchReason.NONFINITE_GRAD_NORM
GRAD_NORM_SPIKE = BadBatchReason.GRAD_NORM_SPIKE
SKIP_REASONS = (NONFINITE_LOSS, NONFINITE_GRAD_NORM, GRAD_NORM_SPIKE)


def skip_reason(accepted: bool, loss: float, norm: float) -> BadBatchReason | None:
    """The bad-batch report's reason for a step the guard judged (None when it was accepted), from the loss
    and norm it judged: the rule's first failing check. Exact, since the step hands back those very values."""
    if accepted:
        return None
    if not math.isfinite(loss):
        return NONFINITE_LOSS
    if not math.isfinite(norm):
        return NONFINITE_GRAD_NORM
    return GRAD_NORM_SPIKE


@dataclass(frozen=True)
class GuardSettings:
    """spike_factor > 1 (math.inf turns spike detection off), spike_zscore > 0 and spike_ceiling > 1 (both
    finite), warmup_steps >= 1, mean_horizon >= 1: the in-step rule above. loss_factor > 1 and loss_zscore > 0
    (finite): a reproduced spike is bad data when its loss is above loss_factor × the running geometric mean
    of the loss and its logarithm more than loss_zscore standard deviations above their mean (`loss_raised`)."""

    spike_factor: float = 12.0
    spike_zscore: float = 8.0
    spike_ceiling: float = 50.0
    warmup_steps: int = 10
    mean_horizon: int = 100
    loss_factor: float = 2.0
    loss_zscore: float = 4.0

    def __post_init__(self) -> None:
        if not _is_number(self.spike_factor) or math.isnan(self.spike_factor) or self.spike_factor <= 1:
            raise ValueError(f"spike_factor must be a number above 1, not {self.spike_factor!r}")
        for name, minimum in (("spike_zscore", 0), ("spike_ceiling", 1), ("loss_factor", 1), ("loss_zscore", 0)):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or value <= minimum:
                raise ValueError(f"{name} must be a finite number above {minimum}, not {value!r}")
        for name in ("warmup_steps", "mean_horizon"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer of at least 1, not {value!r}")

    @property
    def spike_check(self) -> bool:
        """False when spike_factor is infinite: no finite norm is then ever a spike."""
        return math.isfinite(self.spike_factor)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> GuardSettings:
        """TRAINERD_SPIKE_FACTOR, TRAINERD_SPIKE_ZSCORE, TRAINERD_SPIKE_CEILING, TRAINERD_LOSS_FACTOR,
        TRAINERD_LOSS_ZSCORE (numbers) and TRAINERD_SPIKE_WARMUP_STEPS (an integer), each defaulting to the
        field's default when unset or empty; the ValueError names the variables that were set."""
        variables = {"spike_factor": (SPIKE_FACTOR_ENV, float), "spike_zscore": (SPIKE_ZSCORE_ENV, float),
                     "spike_ceiling": (SPIKE_CEILING_ENV, float), "warmup_steps": (SPIKE_WARMUP_STEPS_ENV, int),
                     "loss_factor": (LOSS_FACTOR_ENV, float), "loss_zscore": (LOSS_ZSCORE_ENV, float)}
        given = {field: (variable, parse) for field, (variable, parse) in variables.items() if environ.get(variable)}
        try:
            return cls(**{field: parse(environ[variable]) for field, (variable, parse) in given.items()})
        except ValueError as exc:
            shown = " ".join(f"{variable}={environ[variable]!r}" for variable, _ in given.values())
            raise ValueError(f"{shown}: {exc}") from exc


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class GuardState:
    """What the guard remembers between steps (in the step: the Parameters guard.log_norm_mean,
    guard.log_norm_var, guard.accepted_steps, guard.log_loss_mean and guard.log_loss_var): the running mean
    and variance of log(norm) and of log(loss) over the accepted steps, and their count."""

    log_norm_mean: float = 0.0
    log_norm_var: float = 0.0
    accepted_steps: int = 0
    log_loss_mean: float = 0.0
    log_loss_var: float = 0.0


def _log32(value: float) -> np.float32:
    """log(value) rounded to float32, -inf for 0 (what MindSpore's kernel gives within an ulp)."""
    value32 = float(np.float32(value))
    return np.float32(math.log(value32)) if value32 > 0 else np.float32(-np.inf)


def log_norm_excess(settings: GuardSettings, log_norm_mean: float, norm: float) -> np.float32:
    """delta of the rule for a finite norm: log(norm) (rounded to float32) - mean, at least -log(spike_ceiling)."""
    f32 = np.float32
    return max(_log32(norm) - f32(log_norm_mean), f32(-math.log(settings.spike_ceiling)))


def spike_limit(settings: GuardSettings, log_norm_var: float | np.floating) -> np.float32:
    """The rule's limit for delta once the warm-up is over (inf when spike detection is off)."""
    f32 = np.float32
    floor, ceiling = f32(math.log(settings.spike_factor)), f32(math.log(settings.spike_ceiling))
    return max(floor, min(f32(settings.spike_zscore) * np.sqrt(f32(log_norm_var)), ceiling))


def loss_raised(settings: GuardSettings, state: GuardState, loss: float) -> bool:
    """Whether `loss` stands out from the accepted steps' losses: non-finite, or (after the warm-up) above
    loss_factor × their geometric mean and more than loss_zscore standard deviations of log(loss) above its
    mean. Before the warm-up ends no norm is suspect either, so this is asked only after it."""
    if not math.isfinite(loss):
        return True
    if state.accepted_steps < settings.warmup_steps:
        return False
    excess = float(_log32(loss)) - state.log_loss_mean
    limit = max(math.log(settings.loss_factor), settings.loss_zscore * math.sqrt(max(state.log_loss_var, 0.0)))
    return excess > limit


def _moved(mean: np.float32, var: np.float32, delta: np.float32, weight: np.float32) -> tuple[float, float]:
    step = delta / weight
    return float(mean + step), float(var + (delta * (delta - step) - var) / weight)


def decide(settings: GuardSettings, state: GuardState, loss: float, norm: float,
           force: bool = False) -> tuple[BadBatchReason | None, GuardState]:
    """The in-step rule for one step: its refusal reason (None when accepted) and the guard's state after it.
    `force` accepts a finite spike (a replay the judge cleared), never a non-finite loss or norm."""
    f32 = np.float32
    if not np.isfinite(f32(loss)):
        return NONFINITE_LOSS, state
    if not np.isfinite(f32(norm)):
        return NONFINITE_GRAD_NORM, state
    delta = log_norm_excess(settings, state.log_norm_mean, norm)
    spike = state.accepted_steps >= settings.warmup_steps and delta > spike_limit(settings, f32(state.log_norm_var))
    if spike and not force:
        return GRAD_NORM_SPIKE, state
    weight = f32(min(state.accepted_steps + 1, settings.mean_horizon))
    norm_mean, norm_var = _moved(f32(state.log_norm_mean), f32(state.log_norm_var), delta, weight)
    loss_delta = max(_log32(loss) - f32(state.log_loss_mean), f32(-math.log(settings.spike_ceiling)))
    loss_mean, loss_var = _moved(f32(state.log_loss_mean), f32(state.log_loss_var), loss_delta, weight)
    return None, GuardState(norm_mean, norm_var, state.accepted_steps + 1, loss_mean, loss_var)
