"""The guarded optimizer step: skip the update for a bad batch inside the compiled step, where a callback
would come too late (the weights are spoiled by then). The rule is `trainer.runtime.guard_policy`'s.

    guard = StepGuard(GuardSettings.from_environ())
    apply = GuardedApplyGradients(optimizer, grad_sums, communication.gradient_reducer(ctx, params),
                                  mean_over_ranks(ctx.world_size), guard, max_grad_norm=5.0)
    loss, norm, reason = apply(micro_batches, *micro_batch_losses)   # every rank gets the same three
    skip_reason(int(reason.asnumpy()))   # None, "nonfinite_loss", "nonfinite_grad_norm" or "grad_norm_spike"

Every rank decides alike: the loss is the all-reduced mean and the norm is that of the all-reduced
gradients. The guard's state is two Parameters, `guard.norm_mean` (float32) and `guard.accepted_steps`
(int32): checkpoint them with the network and the optimizer (`parameters_to_numpy(network, optimizer,
guard)`) so a resumed job judges spikes exactly as the uninterrupted one would.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from trainer.runtime.guard_policy import (
    ACCEPTED,
    GRAD_NORM_SPIKE,
    NONFINITE_GRAD_NORM,
    NONFINITE_LOSS,
    GuardSettings,
)

NORM_MEAN = "guard.norm_mean"
ACCEPTED_STEPS = "guard.accepted_steps"


class StepGuard(nn.Cell):
    """`guard(loss, norm) -> reason code` (int32 scalar): decides one step and, when it is accepted, updates
    the running mean. Call it once per step, inside the step's graph, and apply the update only on ACCEPTED.
    """

    def __init__(self, settings: GuardSettings | None = None) -> None:
        super().__init__(auto_prefix=False)
        settings = settings or GuardSettings()
        self.settings = settings
        self.norm_mean = ms.Parameter(ms.Tensor(0.0, ms.float32), name=NORM_MEAN, requires_grad=False)
        self.accepted_steps = ms.Parameter(ms.Tensor(0, ms.int32), name=ACCEPTED_STEPS, requires_grad=False)
        self._spike_factor = ms.Tensor(settings.spike_factor, ms.float32)
        self._warmup_steps = ms.Tensor(settings.warmup_steps, ms.int32)
        self._mean_horizon = ms.Tensor(settings.mean_horizon, ms.int32)
        self._codes = tuple(ms.Tensor(code, ms.int32)
                            for code in (ACCEPTED, NONFINITE_LOSS, NONFINITE_GRAD_NORM, GRAD_NORM_SPIKE))

    def construct(self, loss: ms.Tensor, norm: ms.Tensor) -> ms.Tensor:
        accepted, nonfinite_loss, nonfinite_norm, spike = self._codes
        mean = self.norm_mean
        count = self.accepted_steps
        is_spike = ops.logical_and(count >= self._warmup_steps, norm > self._spike_factor * mean)
        reason = ops.select(ops.isfinite(loss),
                            ops.select(ops.isfinite(norm), ops.select(is_spike, spike, accepted), nonfinite_norm),
                            nonfinite_loss)
        ok = reason == accepted
        weight = ops.cast(ops.minimum(count + 1, self._mean_horizon), ms.float32)
        ops.assign(self.norm_mean, ops.select(ok, mean + (norm - mean) / weight, mean))
        ops.assign_add(self.accepted_steps, ops.cast(ok, ms.int32))
        return reason


class GuardedApplyGradients(nn.Cell):
    """Average the summed gradients over micro batches and ranks, judge the step, and only if it is accepted
    clip (when `max_grad_norm` is set) and update; then clear the sums.

    `apply(micro_batches, *losses) -> (loss, norm, reason)`: `micro_batches` a float32 scalar Tensor (the
    number of micro batches summed), `losses` this rank's micro-batch mean losses (scalar Tensors, passed as
    separate arguments: MindSpore takes a tuple argument's Tensors for constants and recompiles when they
    change); `loss` is the global mean loss, `norm` the global norm before clipping, `reason` the guard's code.

    With `guard=None` the step is unguarded except for a non-finite norm (reason NONFINITE_GRAD_NORM), as
    the example job's step was before: the baseline the bench compares with.
    """

    def __init__(self, optimizer: nn.Optimizer, grad_sums: ms.ParameterTuple, reducer: nn.Cell,
                 loss_reducer: nn.Cell, guard: StepGuard | None, max_grad_norm: float | None = None) -> None:
        super().__init__(auto_prefix=False)
        self.optimizer = optimizer
        self.grad_sums = grad_sums
        self.reducer = reducer
        self.loss_reducer = loss_reducer
        self.guard = guard
        self.guarded = guard is not None
        self.clip = max_grad_norm is not None
        self.max_grad_norm = ms.Tensor(max_grad_norm if max_grad_norm is not None else 0.0, ms.float32)
        self._accepted = ms.Tensor(ACCEPTED, ms.int32)
        self._nonfinite_norm = ms.Tensor(NONFINITE_GRAD_NORM, ms.int32)

    def construct(self, micro_batches: ms.Tensor, *losses: ms.Tensor) -> tuple[ms.Tensor, ms.Tensor, ms.Tensor]:
        loss = self.loss_reducer(ops.addn(losses) / micro_batches)
        grads = self.reducer(tuple([grad_sum / micro_batches for grad_sum in self.grad_sums]))
        norm = ops.sqrt(ops.addn([ops.reduce_sum(ops.square(grad)) for grad in grads]))
        if self.guarded:
            reason = self.guard(loss, norm)
        else:
            reason = ops.select(ops.isfinite(norm), self._accepted, self._nonfinite_norm)
        if reason == self._accepted:
            if self.clip:
                scale = self.max_grad_norm / ops.maximum(norm, self.max_grad_norm)
                grads = tuple([grad * scale for grad in grads])
            self.optimizer(grads)
        for grad_sum in self.grad_sums:
            ops.assign(grad_sum, ops.zeros_like(grad_sum))
        return loss, norm, reason


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
