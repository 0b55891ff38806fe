"""When an optimizer step is skipped as a bad batch: the settings, the rule in plain Python, and the
reason a skip is reported with. `trainer.runtime.guard` runs the same rule inside the compiled step; this
twin documents it and serves the tests. Pure: no MindSpore.

The rule, for a step's global mean loss and the global norm of its all-reduced gradients (before clipping),
with the guard's state (mean, var, accepted_steps) and delta = max(log(norm) - mean, -log(spike_ceiling)):
1. the loss is not finite                                    -> skipped, "nonfinite_loss"
2. else the norm is not finite                               -> skipped, "nonfinite_grad_norm"
3. else after `warmup_steps` accepted steps, delta > limit   -> skipped, "grad_norm_spike", where
       limit = max(log(spike_factor), min(spike_zscore × sqrt(var), log(spike_ceiling)))
4. else accepted: the optimizer updates, accepted_steps += 1, and mean and var move by delta.
A skipped step changes nothing: no weights, no optimizer state, no guard state.

In words: with the running geometric mean of the accepted norms g = exp(mean) and the running standard
deviation of their logarithms sigma = sqrt(var), a norm above spike_ceiling × g is always a spike, a norm
at most spike_factor × g never is (spike_factor wins where it is the larger), and in between a norm is a
spike when its logarithm lies more than spike_zscore standard deviations above the mean.

The defaults, spike_factor = spike_ceiling = 12, make the rule "a norm above 12 × g": the gradient norm
alone cannot tell a bad batch from a healthy model's own excursions below that, and both examples make them
on clean data. In `bench/guard.py`'s 20,000 clean steps the MLP example's norm reached 10.5 × g (sigma
0.86), and the Transformer example's 11.7 × g (step 12180, sigma 0.31, the loss unchanged); in a steady
phase of the latter (sigma 0.14) single steps jumped to 3-4.4 × g (z-scores up to 9.8) and straight back,
the loss unchanged; at 3 ranks it reached 3.95 × g at z 6.14
(`tests/trainer/data/transformer_lm_3_ranks_norms.txt`). Judged by a floor of 3 and a z-score of 6 (the
defaults before), 27 of those 20,000 clean Transformer steps were spikes; with a z-score of 8, 9; with a
floor of 5, 2. An injected 20x spike stays caught: 20 times the median of the last 100 norms was never below
14 × g. The margins are thin on both sides (11.7 against 12 against 14): the norm alone can do no better,
and the loss, which these excursions leave unchanged, is the signal a finer rule would add. A job whose norm
is known to be steadier can lower spike_factor (to 3, say): the z-score then catches smaller spikes while
the norm has been steady, and the limit still adapts to how much the norm fluctuates at this point of
training (late in training the norm is small and its relative fluctuation large; a fixed 3 × the mean
skipped healthy batches there).
spike_factor = inf turns spike detection off; a non-finite loss or norm is always
skipped. delta is held to at least -log(spike_ceiling) so that no accepted step moves the statistics much
further down than a spike could move them up: a zero norm (log -inf), which is no bad batch, would
otherwise drag the mean so low that every later step looked like a spike, and a skipped step never moves
it back.

mean and var are the true mean and (population) variance of log(norm) (as clamped: mean + delta) over
the accepted steps for the first `mean_horizon` of them, then exponential moving averages with weight
1 / mean_horizon (Welford's update with the weight w = min(accepted_steps + 1, mean_horizon); delta - step
is the new distance to the mean):
    step = delta / w;  mean += step;  var += (delta × (delta - step) - var) / w
An average over all of history would go stale as training moves the norm; a plain EMA started at zero
would need a bias correction during warm-up; this form needs neither. All arithmetic is float32, in this
order, in both twins. The logarithm is the one thing they do not share bit for bit: here it is the
float32 rounding of the exact logarithm, in the step it is MindSpore's CPU kernel, a last bit off for a
few arguments in a thousand; so the twins' states agree to a few ulps, and their decisions agree but
for a norm within a few ulps of the limit. Every rank runs the same kernel on the same all-reduced loss
and norm, so the ranks always agree with each other.

MindFormers' bad-batch skipping (`use_skip_data_by_global_norm` with `monitor_config.global_norm_spike_threshold`
and `global_norm_spike_count_threshold`) skips the update inside the step when the global norm reaches a
fixed threshold, and a callback (TrainingStateMonitor) counts consecutive skips, resets the count on a good
step and stops training when it reaches the count threshold. Here the threshold follows the norm's own
recent level and spread, so no norm has to be known in advance, and counting consecutive skips is the
coordinator's: after `max_consecutive_spikes` it rolls back and extends the skip ledger.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from proto.progress_datagram import BadBatchReason

NONFINITE_LOSS = BadBatchReason.NONFINITE_LOSS
NONFINITE_GRAD_NORM = BadBatchReason.NONFINITE_GRAD_NORM
GRAD_NORM_SPIKE = BadBatchReason.GRAD_NORM_SPIKE
SKIP_REASONS = (NONFINITE_LOSS, NONFINITE_GRAD_NORM, GRAD_NORM_SPIKE)

SPIKE_FACTOR_ENV = "TRAINERD_SPIKE_FACTOR"
SPIKE_ZSCORE_ENV = "TRAINERD_SPIKE_ZSCORE"
SPIKE_CEILING_ENV = "TRAINERD_SPIKE_CEILING"
WARMUP_STEPS_ENV = "TRAINERD_SPIKE_WARMUP_STEPS"

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
    finite), warmup_steps >= 1, mean_horizon >= 1. The rule above says what each does."""

    spike_factor: float = 12.0
    spike_zscore: float = 8.0
    spike_ceiling: float = 12.0
    warmup_steps: int = 10
    mean_horizon: int = 100

    def __post_init__(self) -> None:
        if not _is_number(self.spike_factor) or math.isnan(self.spike_factor) or self.spike_factor <= 1:
            raise ValueError(f"spike_factor must be a number above 1, not {self.spike_factor!r}")
        for name, minimum in (("spike_zscore", 0), ("spike_ceiling", 1)):
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
        """TRAINERD_SPIKE_FACTOR, TRAINERD_SPIKE_ZSCORE, TRAINERD_SPIKE_CEILING (numbers) and
        TRAINERD_SPIKE_WARMUP_STEPS (an integer), each defaulting to the field's default when unset or
        empty; the ValueError names the variables that were set."""
        variables = {"spike_factor": (SPIKE_FACTOR_ENV, float), "spike_zscore": (SPIKE_ZSCORE_ENV, float),
                     "spike_ceiling": (SPIKE_CEILING_ENV, float), "warmup_steps": (WARMUP_STEPS_ENV, int)}
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
    guard.log_norm_var and guard.accepted_steps): the running mean and variance of log(norm) over the
    accepted steps, and their count."""

    log_norm_mean: float = 0.0
    log_norm_var: float = 0.0
    accepted_steps: int = 0


def log_norm_excess(settings: GuardSettings, log_norm_mean: float, norm: float) -> np.float32:
    """delta of the rule for a finite norm: log(norm) (rounded to float32) - mean, at least -log(spike_ceiling)."""
    f32 = np.float32
    norm32 = float(f32(norm))
    log32 = f32(math.log(norm32)) if norm32 > 0 else f32(-np.inf)
    return max(log32 - f32(log_norm_mean), f32(-math.log(settings.spike_ceiling)))


def spike_limit(settings: GuardSettings, log_norm_var: float | np.floating) -> np.float32:
    """The rule's limit for delta once the warm-up is over (inf when spike detection is off)."""
    f32 = np.float32
    floor, ceiling = f32(math.log(settings.spike_factor)), f32(math.log(settings.spike_ceiling))
    return max(floor, min(f32(settings.spike_zscore) * np.sqrt(f32(log_norm_var)), ceiling))


def decide(settings: GuardSettings, state: GuardState, loss: float,
           norm: float) -> tuple[BadBatchReason | None, GuardState]:
    """The rule for one step: its skip reason (None when accepted) and the guard's state after it."""
    f32 = np.float32
    if not np.isfinite(f32(loss)):
        return NONFINITE_LOSS, state
    if not np.isfinite(f32(norm)):
        return NONFINITE_GRAD_NORM, state
    mean, var = f32(state.log_norm_mean), f32(state.log_norm_var)
    delta = log_norm_excess(settings, state.log_norm_mean, norm)
    if state.accepted_steps >= settings.warmup_steps and delta > spike_limit(settings, var):
        return GRAD_NORM_SPIKE, state
    weight = f32(min(state.accepted_steps + 1, settings.mean_horizon))
    step = delta / weight
    new_mean = mean + step
    new_var = var + (delta * (delta - step) - var) / weight
    return None, GuardState(float(new_mean), float(new_var), state.accepted_steps + 1)
