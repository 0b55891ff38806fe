"""The guarded optimizer step: skip the update for a bad batch inside the compiled step, where a callback
would come too late (the weights are spoiled by then). The rule is `trainer.runtime.guard_policy`'s.

    guard = StepGuard(GuardSettings.from_environ())
    apply = GuardedApplyGradients(optimizer, grad_sums, communication.gradient_reducer(ctx, params),
                                  mean_over_ranks(ctx.world_size), guard, max_grad_norm=5.0)
    loss, norm, accepted, local_norm = apply(attempt_input(AttemptKind.FIRST), micro_batches, *micro_batch_losses)
    # loss, norm and accepted are the same on every rank; local_norm is this rank's own gradients' norm

A refused step is suspect, not yet bad: `trainer.runtime.step_replay.StepJudge` computes it again (with
a forced replay when it cleared a spike) before anything is blamed.

Every rank decides alike: the loss is the all-reduced mean and the norm is that of the all-reduced
gradients. The guard's state is five Parameters, `guard.log_norm_mean`, `guard.log_norm_var`,
`guard.log_loss_mean`, `guard.log_loss_var` (float32) and `guard.accepted_steps` (int32): checkpoint them
with the network and the optimizer (`parameters_to_numpy(network, optimizer, guard)`) so a resumed job
judges as the uninterrupted one would. A checkpoint of the guard before the z-score rule (whose state was
`guard.norm_mean`) cannot be resumed with it: `check_guard_state` refuses it in one line; one of the guard
before the loss statistics resumes with them learnt afresh (`check_guard_state` says which are missing).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from trainer.checkpoint.errors import CheckpointError
from trainer.runtime.guard_policy import GuardSettings, GuardState
from trainer.runtime.step_replay import AttemptKind

LOG_NORM_MEAN = "guard.log_norm_mean"
LOG_NORM_VAR = "guard.log_norm_var"
ACCEPTED_STEPS = "guard.accepted_steps"
LOG_LOSS_MEAN = "guard.log_loss_mean"
LOG_LOSS_VAR = "guard.log_loss_var"
RETIRED_NORM_MEAN = "guard.norm_mean"  # the state of the guard before the z-score rule
# The loss statistics came later: a checkpoint without them resumes with them learnt from the next steps.
LEARNT_AFRESH = (LOG_LOSS_MEAN, LOG_LOSS_VAR)
NOT_FORCED = ms.Tensor(False, ms.bool_)  # StepGuard's force input for a step judged as it comes


def attempt_input(kind: AttemptKind) -> ms.Tensor:
    """GuardedApplyGradients' (and GuardedTrainOneStepCell's step's) attempt input for `kind`."""
    return _ATTEMPT_INPUTS[kind]


_ATTEMPT_INPUTS = {kind: ms.Tensor(int(kind), ms.int32) for kind in AttemptKind}


class StepGuard(nn.Cell):
    """`guard(loss, norm, force) -> accepted` (a bool scalar Tensor): judges one step and, when it is accepted,
    updates the running means and variances of log(norm) and log(loss) and the count. Call it once per step
    inside the step's graph and apply the update only when it accepts; `force` (a bool scalar Tensor) accepts
    a finite spike; `guard_policy.skip_reason(accepted, loss, norm)` names a refusal's reason.

    Few kernels by design (each costs microseconds on a CPU): the checks are one comparison,
    `(loss - loss) + (log(norm) - mean) <= limit`, false for a NaN or infinite loss (loss - loss is NaN, and
    NaN compares false), a NaN norm (its log is NaN), an infinite one (the limit is finite: the largest
    float32 in the warm-up) and a spike; the limit's logarithms are taken here. The clamp of the rule comes
    after the check: `maximum(NaN, y)` is y on MindSpore's CPU, and would hide a NaN norm. (No clamping with
    `minimum(x, float32 max)` either: in GRAPH mode MindSpore 2.10 simplifies that to x, also when x is
    infinite.)
    """

    def __init__(self, settings: GuardSettings | None = None) -> None:
        super().__init__(auto_prefix=False)
        settings = settings or GuardSettings()
        self.settings = settings
        self.log_norm_mean = ms.Parameter(ms.Tensor(0.0, ms.float32), name=LOG_NORM_MEAN, requires_grad=False)
        self.log_norm_var = ms.Parameter(ms.Tensor(0.0, ms.float32), name=LOG_NORM_VAR, requires_grad=False)
        self.accepted_steps = ms.Parameter(ms.Tensor(0, ms.int32), name=ACCEPTED_STEPS, requires_grad=False)
        self.log_loss_mean = ms.Parameter(ms.Tensor(0.0, ms.float32), name=LOG_LOSS_MEAN, requires_grad=False)
        self.log_loss_var = ms.Parameter(ms.Tensor(0.0, ms.float32), name=LOG_LOSS_VAR, requires_grad=False)
        self._spike_check = settings.spike_check
        self._log_floor = ms.Tensor(math.log(settings.spike_factor) if self._spike_check else 0.0, ms.float32)
        self._log_ceiling = ms.Tensor(math.log(settings.spike_ceiling), ms.float32)
        self._zscore = ms.Tensor(settings.spike_zscore, ms.float32)
        self._warmup_steps = ms.Tensor(settings.warmup_steps, ms.int32)
        self._mean_horizon = ms.Tensor(settings.mean_horizon, ms.int32)
        self._lowest_delta = ms.Tensor(-math.log(settings.spike_ceiling), ms.float32)
        self._no_limit = ms.Tensor(np.finfo(np.float32).max, ms.float32)

    def construct(self, loss: ms.Tensor, norm: ms.Tensor, force: ms.Tensor) -> ms.Tensor:
        mean = self.log_norm_mean
        var = self.log_norm_var
        count = self.accepted_steps
        excess = ops.log(norm) - mean
        limit = self._no_limit
        if self._spike_check:
            spread = ops.minimum(self._zscore * ops.sqrt(var), self._log_ceiling)
            limit = ops.select(count >= self._warmup_steps, ops.maximum(self._log_floor, spread), self._no_limit)
        limit = ops.select(force, self._no_limit, limit)
        accepted = (loss - loss) + excess <= limit
        weight = ops.cast(ops.minimum(count + 1, self._mean_horizon), ms.float32)
        self._move(self.log_norm_mean, self.log_norm_var, ops.maximum(excess, self._lowest_delta), weight, accepted)
        loss_delta = ops.maximum(ops.log(loss) - self.log_loss_mean, self._lowest_delta)
        self._move(self.log_loss_mean, self.log_loss_var, loss_delta, weight, accepted)
        ops.assign_add(self.accepted_steps, ops.cast(accepted, ms.int32))
        return accepted

    def _move(self, mean: ms.Parameter, var: ms.Parameter, delta: ms.Tensor, weight: ms.Tensor,
              accepted: ms.Tensor) -> None:
        """Welford's update of (mean, var) by delta at `weight`, kept only when the step is accepted."""
        mean_step = delta / weight
        new_mean = mean + mean_step
        new_var = var + (delta * (delta - mean_step) - var) / weight
        ops.assign(mean, ops.select(accepted, new_mean, mean))
        ops.assign(var, ops.select(accepted, new_var, var))

    def rebaseline(self, loss: float, norm: float) -> None:
        """Forget the statistics: the next `warmup_steps` accepted steps learn them again, starting from this
        step's loss and norm (a mean of 0 would clamp the first deltas, see guard_policy). Between steps."""
        for parameter, value in ((self.log_norm_mean, norm), (self.log_loss_mean, loss)):
            if math.isfinite(value) and value > 0:
                parameter.set_data(ms.Tensor(math.log(value), ms.float32))
        self.log_norm_var.set_data(ms.Tensor(0.0, ms.float32))
        self.log_loss_var.set_data(ms.Tensor(0.0, ms.float32))
        self.accepted_steps.set_data(ms.Tensor(0, ms.int32))

    def state(self) -> GuardState:
        """The statistics as they stand (a read to the host: between steps)."""
        return GuardState(float(self.log_norm_mean.asnumpy()), float(self.log_norm_var.asnumpy()),
                          int(self.accepted_steps.asnumpy()), float(self.log_loss_mean.asnumpy()),
                          float(self.log_loss_var.asnumpy()))


def check_guard_state(state: Mapping[str, np.ndarray], *cells: nn.Cell) -> Mapping[str, np.ndarray]:
    """`state` (a checkpoint's tensors by name) ready to load into cells that may include a StepGuard.
    Raises CheckpointError when it holds the state of the guard before the z-score rule (`guard.norm_mean`):
    a running mean of the norm gives neither the mean nor the spread of its logarithm, so the resumed run
    would judge spikes against made-up figures. A checkpoint of the guard before the loss statistics gets them
    at 0 (a loss of 1, no spread): a running mean moves from there by at most log(spike_ceiling) / mean_horizon
    a step, so for its first few hundred steps a spike's loss is judged against a loss of about 1."""
    guarded = any(param.name == LOG_NORM_MEAN for cell in cells for param in cell.get_parameters())
    if not guarded:
        return state
    if LOG_NORM_MEAN not in state and RETIRED_NORM_MEAN in state:
        raise CheckpointError(f"it holds the bad-batch guard state of an older trainerd ({RETIRED_NORM_MEAN}), "
                              f"which the z-score guard ({LOG_NORM_MEAN}, {LOG_NORM_VAR}) cannot judge spikes "
                              "with: resume it with the trainerd that wrote it, or start the job afresh")
    missing = [name for name in LEARNT_AFRESH if name not in state]
    if LOG_NORM_MEAN not in state or not missing:
        return state
    return {**state, **{name: np.zeros((), np.float32) for name in missing}}


class GuardedApplyGradients(nn.Cell):
    """Average the summed gradients over micro batches and ranks, judge the step, and only if it is accepted
    clip (when `max_grad_norm` is set) and update; then clear the sums.

    `apply(attempt, micro_batches, *losses) -> (loss, norm, accepted, local_norm)`:
    - `attempt`: an int32 scalar Tensor, `attempt_input(AttemptKind...)` (a forced replay has a finite spike
      accepted);
    - `micro_batches`: a float32 scalar Tensor, the number of micro batches summed;
    - `losses`: this rank's micro-batch mean losses, scalar Tensors passed as separate arguments (MindSpore
      takes a tuple argument's Tensors for constants and recompiles when they change);
    - `loss`: the global mean loss; `norm`: the global norm before clipping; `accepted`: whether the update was
      applied (a bool scalar);
    - `local_norm`: the norm of this rank's own mean gradients before the all-reduce (what a replay compares to
      name a rank whose device computed wrong), computed on a replay and on a refused first attempt only (0 on
      an accepted first attempt: it costs a reduction over every gradient).

    With `guard=None` the step is unguarded but for a non-finite norm, as the example job's step was
    before: the baseline the bench compares with.
    """

    def __init__(self, optimizer: nn.Optimizer, grad_sums: ms.ParameterTuple, reducer: nn.Cell,
                 loss_reducer: nn.Cell, guard: StepGuard | None, max_grad_norm: float | None = None) -> None:
        super().__init__(auto_prefix=False)
        self.optimizer = optimizer
        self.grad_sums = grad_sums
        self.reducer = reducer
        self.loss_reducer = loss_reducer
        self.guard = guard
        self.clip = max_grad_norm is not None
        self.max_grad_norm = ms.Tensor(max_grad_norm if max_grad_norm is not None else 0.0, ms.float32)
        self._no_norm = ms.Tensor(0.0, ms.float32)

    def construct(self, attempt: ms.Tensor, micro_batches: ms.Tensor,
                  *losses: ms.Tensor) -> tuple[ms.Tensor, ms.Tensor, ms.Tensor, ms.Tensor]:
        loss = self.loss_reducer(ops.addn(losses) / micro_batches)
        local = tuple([grad_sum / micro_batches for grad_sum in self.grad_sums])
        grads = self.reducer(local)
        norm = global_norm(grads)
        if self.guard is not None:
            accepted = self.guard(loss, norm, attempt > 1)
        else:
            accepted = ops.isfinite(norm)
        if accepted:
            if self.clip:
                scale = self.max_grad_norm / ops.maximum(norm, self.max_grad_norm)
                grads = tuple([grad * scale for grad in grads])
            self.optimizer(grads)
        local_norm = self._no_norm
        if ops.logical_or(attempt > 0, ops.logical_not(accepted)):
            local_norm = global_norm(local)
        for grad_sum in self.grad_sums:
            ops.assign(grad_sum, ops.zeros_like(grad_sum))
        return loss, norm, accepted, local_norm


def global_norm(grads: tuple[ms.Tensor, ...]) -> ms.Tensor:
    """The float32 norm of all of `grads` together (inside a graph)."""
    return ops.sqrt(ops.addn([ops.reduce_sum(ops.square(ops.cast(grad, ms.float32))) for grad in grads]))


class _MeanOverRanks(nn.Cell):
    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.all_reduce = ops.AllReduce()
        self.world_size = ms.Tensor(world_size, ms.float32)

    def construct(self, value: ms.Tensor) -> ms.Tensor:
        return self.all_reduce(value) / self.world_size


def mean_over_ranks(world_size: int) -> nn.Cell:
    """The loss reducer: the mean of a float32 scalar over all ranks (the identity on a single rank).
    Build it after `communication.initialize`."""
    if world_size < 1:
        raise ValueError(f"the world size must be at least 1, not {world_size}")
    return nn.Identity() if world_size == 1 else _MeanOverRanks(world_size)
