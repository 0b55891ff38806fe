"""When an optimizer step is skipped as a bad batch: the settings, the rule in plain Python, and the
reason a skip is reported with. `trainer.runtime.guard` runs the same rule inside the compiled step; this
twin documents it and serves the tests. Pure: no MindSpore.

The rule, for a step's global mean loss and the global norm of its all-reduced gradients (before clipping):
1. the loss is not finite                                    -> skipped, "nonfinite_loss"
2. else the norm is not finite                               -> skipped, "nonfinite_grad_norm"
3. else after `warmup_steps` accepted steps, norm > spike_factor × norm_mean -> skipped, "grad_norm_spike"
4. else accepted: the optimizer updates, accepted_steps += 1 and norm_mean moves towards the norm.
A skipped step changes nothing: no weights, no optimizer state, no guard state.

norm_mean is the true mean of the accepted norms for the first `mean_horizon` accepted steps, then an
exponential moving average with weight 1 / mean_horizon:
    norm_mean += (norm - norm_mean) / min(accepted_steps + 1, mean_horizon)
An average over all of history would go stale as training moves the norm; a plain EMA started at zero
would need a bias correction during warm-up; this form needs neither. All arithmetic is float32.

MindFormers' bad-batch skipping (`use_skip_data_by_global_norm` with `monitor_config.global_norm_spike_threshold`
and `global_norm_spike_count_threshold`) skips the update inside the step when the global norm reaches a
fixed threshold, and a callback (TrainingStateMonitor) counts consecutive skips, resets the count on a good
step and stops training when it reaches the count threshold. Here the threshold is relative to the running
mean, so no norm has to be known in advance, and counting consecutive skips is the coordinator's: after
`max_consecutive_spikes` it rolls back and extends the skip ledger.
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
    """spike_factor > 1 (math.inf turns spike detection off), warmup_steps >= 1, mean_horizon >= 1."""

    spike_factor: float = 3.0
    warmup_steps: int = 10
    mean_horizon: int = 100

    def __post_init__(self) -> None:
        if isinstance(self.spike_factor, bool) or not isinstance(self.spike_factor, (int, float)) \
                or math.isnan(self.spike_factor) or self.spike_factor <= 1:
            raise ValueError(f"the spike factor must be a number above 1, not {self.spike_factor!r}")
        for name in ("warmup_steps", "mean_horizon"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer of at least 1, not {value!r}")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> GuardSettings:
        """TRAINERD_SPIKE_FACTOR (default 3.0) and TRAINERD_SPIKE_WARMUP_STEPS (default 10); the ValueError
        names the variable."""
        defaults = cls()
        factor, warmup = defaults.spike_factor, defaults.warmup_steps
        try:
            if environ.get(SPIKE_FACTOR_ENV, ""):
                factor = float(environ[SPIKE_FACTOR_ENV])
            if environ.get(WARMUP_STEPS_ENV, ""):
                warmup = int(environ[WARMUP_STEPS_ENV])
            return cls(spike_factor=factor, warmup_steps=warmup)
        except ValueError as exc:
            raise ValueError(f"{SPIKE_FACTOR_ENV}={environ.get(SPIKE_FACTOR_ENV)!r} "
                             f"{WARMUP_STEPS_ENV}={environ.get(WARMUP_STEPS_ENV)!r}: {exc}") from exc


@dataclass(frozen=True)
class GuardState:
    """What the guard remembers between steps (in the step: Parameters guard.norm_mean, guard.accepted_steps)."""

    norm_mean: float = 0.0
    accepted_steps: int = 0


def decide(settings: GuardSettings, state: GuardState, loss: float,
           norm: float) -> tuple[BadBatchReason | None, GuardState]:
    """The rule for one step: its skip reason (None when accepted) and the guard's state after it."""
    f32 = np.float32
    loss32, norm32, mean = f32(loss), f32(norm), f32(state.norm_mean)
    if not np.isfinite(loss32):
        return NONFINITE_LOSS, state
    if not np.isfinite(norm32):
        return NONFINITE_GRAD_NORM, state
    if state.accepted_steps >= settings.warmup_steps and math.isfinite(settings.spike_factor):
        with np.errstate(over="ignore"):  # a limit beyond float32 is infinite: no finite norm exceeds it
            if norm32 > f32(settings.spike_factor) * mean:
                return GRAD_NORM_SPIKE, state
    weight = f32(min(state.accepted_steps + 1, settings.mean_horizon))
    return None, GuardState(float(mean + (norm32 - mean) / weight), state.accepted_steps + 1)
