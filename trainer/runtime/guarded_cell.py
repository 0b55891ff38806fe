"""A drop-in for `nn.TrainOneStepCell` that skips a bad batch's update inside the step, on every rank alike.

    model = Model(GuardedTrainOneStepCell(nn.WithLossCell(net, loss_fn), optimizer))
    model.train(epochs, dataset, callbacks=[TrainerdCallback(), LossMonitor(1)], ...)

Model.train takes a train cell as its network when it is given no loss function and no optimizer: it then
calls the cell once per dataset row and hands its outputs to the callbacks (`cb_params.net_outputs`). This
cell returns `(loss, grad_norm, accepted)`: LossMonitor prints the first, TrainerdCallback reports all three.

The step, all inside one compiled graph: forward and backward (of each micro batch), the gradients
averaged over ranks as `nn.TrainOneStepCell` does in data parallel (`DistributedGradReducer`), the loss
averaged over ranks, the global gradient norm, the guard's decision (`trainer.runtime.guard.StepGuard`:
a non-finite loss or norm, or a norm spike, is refused), and the optimizer update only when the step is
accepted. Every rank judges the same all-reduced loss and norm, so all skip together and their weights stay
identical. On an accepted step with one micro batch and no clipping, the update is `nn.TrainOneStepCell`'s
bit for bit.

Gradient accumulation: with `grad_accum` n (by default the launch's TRAINERD_GRAD_ACCUM, 1 outside
trainerd), each input's leading dimension is split into n equal micro batches, run one after another; the
loss and the gradients are their means. `trainerd_dataset` makes each row the n micro batches of one step,
so the global batch stays what the job asked for at any world size.

Replay before blame (`trainer.runtime.step_replay`): when the guard refuses a step, the cell computes it once
more on the same weights and batch before returning, and `last_outcome` says what the step was: bad data
(skipped; TrainerdCallback reports it and the ledger keeps its samples), a device fault (the replay's clean
result stands, and a rank whose own gradients differed between the two is named), or a healthy excursion of
the norm (applied). The step is two graphs' worth of Python: one compiled graph per attempt, and the judge
between them, which costs nothing on an accepted step.

The guard's state (`guard.log_norm_mean`, `guard.log_norm_var`, `guard.log_loss_mean`, `guard.log_loss_var`,
`guard.accepted_steps`) is Parameters of this cell, so TrainerdCallback's checkpoints, which hold every
parameter of the train network, carry it across a resume.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import mindspore as ms
from mindspore import nn, ops
from mindspore.context import ParallelMode
from mindspore.parallel._utils import _get_device_num, _get_gradients_mean, _get_parallel_mode

from trainer.runtime.guard import StepGuard, attempt_input, global_norm, mean_over_ranks
from trainer.runtime.guard_policy import GuardSettings
from trainer.runtime.rank_context import trainerd_launch
from trainer.runtime.step_replay import Attempt, AttemptKind, StepJudge, StepOutcome


class GuardedTrainOneStepCell(nn.Cell):
    """`cell(*inputs) -> (loss, grad_norm, accepted)`: the global mean loss (float32), the global gradient
    norm before clipping (float32), and whether the optimizer updated (a bool scalar), of the attempt that
    stands; `cell.last_outcome` is the step's `StepOutcome`.

    `network` is the network with its loss (e.g. `nn.WithLossCell`), `sens` as for `nn.TrainOneStepCell`;
    `guard_settings` default to the launch's (`GuardSettings.from_environ`: TRAINERD_SPIKE_FACTOR, ...);
    `max_grad_norm`, when given, clips accepted gradients to that global norm.
    """

    def __init__(self, network: nn.Cell, optimizer: nn.Optimizer, sens: float | None = None, *,
                 guard_settings: GuardSettings | None = None, max_grad_norm: float | None = None,
                 grad_accum: int | None = None, environ: Mapping[str, str] | None = None) -> None:
        super().__init__(auto_prefix=False)
        if guard_settings is None:
            guard_settings = GuardSettings.from_environ(os.environ if environ is None else environ)
        self.attempt = _GuardedStep(network, optimizer, sens, guard_settings, max_grad_norm, grad_accum, environ)
        self._judge = StepJudge(guard_settings, self.attempt.guard.state, self.attempt.guard.rebaseline)
        self.last_outcome: StepOutcome | None = None

    @property
    def network(self) -> nn.Cell:
        return self.attempt.network

    @property
    def optimizer(self) -> nn.Optimizer:
        return self.attempt.optimizer

    @property
    def guard(self) -> StepGuard:
        return self.attempt.guard

    @property
    def grad_accum(self) -> int:
        return self.attempt.grad_accum

    def construct(self, *inputs: ms.Tensor) -> tuple[ms.Tensor, ms.Tensor, ms.Tensor]:
        """The first attempt alone: what MindSpore compiles when it compiles the cell itself (Model.build, a
        parallel layout's compile); training runs through __call__."""
        loss, norm, accepted, _ = self.attempt(attempt_input(AttemptKind.FIRST), *inputs)
        return loss, norm, accepted

    def __call__(self, *inputs: ms.Tensor) -> tuple[ms.Tensor, ms.Tensor, ms.Tensor]:
        outputs: list[tuple[ms.Tensor, ...]] = []

        def attempt(kind: AttemptKind) -> Attempt:
            result = self.attempt(attempt_input(kind), *inputs)
            outputs.append(result)
            loss, norm, accepted, local_norm = result
            return Attempt(float(loss.asnumpy()), float(norm.asnumpy()), bool(accepted.asnumpy()),
                           float(local_norm.asnumpy()))

        self.last_outcome = self._judge.run(attempt)
        loss, norm, accepted, _ = outputs[-1]
        return loss, norm, accepted


class _GuardedStep(nn.Cell):
    """One attempt at a step, compiled: `step(attempt, *inputs) -> (loss, norm, accepted, local_norm)`, as
    `trainer.runtime.guard.GuardedApplyGradients` (whose docstring says what each is)."""

    def __init__(self, network: nn.Cell, optimizer: nn.Optimizer, sens: float | None,
                 guard_settings: GuardSettings, max_grad_norm: float | None, grad_accum: int | None,
                 environ: Mapping[str, str] | None) -> None:
        super().__init__(auto_prefix=False)
        if sens == 0:
            raise ValueError("sens cannot be 0")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, not {max_grad_norm}")
        if grad_accum is None:
            ctx = trainerd_launch(environ)
            grad_accum = ctx.batch.grad_accum if ctx is not None and ctx.batch is not None else 1
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be at least 1, not {grad_accum}")
        self.network = network
        self.network.set_grad()
        self.optimizer = optimizer
        self.weights = optimizer.parameters
        self.grad_accum = grad_accum
        self.with_sens = sens is not None
        self.sens = 1.0 if sens is None else sens
        self.grad = ops.GradOperation(get_by_list=True, sens_param=True)
        self.grad_no_sens = ops.GradOperation(get_by_list=True)
        world_size = 1
        self.grad_reducer: nn.Cell = nn.Identity()
        if _get_parallel_mode() in (ParallelMode.DATA_PARALLEL, ParallelMode.HYBRID_PARALLEL):
            world_size = _get_device_num()
            self.grad_reducer = nn.DistributedGradReducer(self.weights, _get_gradients_mean(), world_size)
        self.loss_reducer = mean_over_ranks(world_size)
        self.guard = StepGuard(guard_settings)
        self.clip = max_grad_norm is not None
        self.max_grad_norm = ms.Tensor(max_grad_norm if max_grad_norm is not None else 0.0, ms.float32)
        self._no_norm = ms.Tensor(0.0, ms.float32)

    def construct(self, attempt: ms.Tensor, *inputs: ms.Tensor) -> tuple[ms.Tensor, ...]:
        if self.grad_accum == 1:
            loss, grads = self._loss_and_grads(*inputs)
        else:
            for x in inputs:
                if x.shape[0] % self.grad_accum != 0:
                    raise ValueError("GuardedTrainOneStepCell: a batch does not split into grad_accum micro batches")
            loss, grads = self._loss_and_grads(*self._micro_batch(inputs, 0))
            for i in range(1, self.grad_accum):
                micro_loss, micro_grads = self._loss_and_grads(*self._micro_batch(inputs, i))
                loss = loss + micro_loss
                grads = tuple([total + grad for total, grad in zip(grads, micro_grads)])
            loss = loss / self.grad_accum
            grads = tuple([total / self.grad_accum for total in grads])
        local = grads
        grads = self.grad_reducer(grads)
        loss = self.loss_reducer(ops.cast(loss, ms.float32))
        norm = global_norm(grads)
        accepted = self.guard(loss, norm, attempt > 1)
        if accepted:
            if self.clip:
                scale = self.max_grad_norm / ops.maximum(norm, self.max_grad_norm)
                grads = tuple([grad * ops.cast(scale, grad.dtype) for grad in grads])
            self.optimizer(grads)
        local_norm = self._no_norm
        if ops.logical_or(attempt > 0, ops.logical_not(accepted)):
            local_norm = global_norm(local)
        return loss, norm, accepted, local_norm

    def _loss_and_grads(self, *inputs: ms.Tensor) -> tuple[ms.Tensor, tuple[ms.Tensor, ...]]:
        """`nn.TrainOneStepCell`'s forward and backward."""
        loss = self.network(*inputs)
        if self.with_sens:
            grads = self.grad(self.network, self.weights)(*inputs, ops.fill(loss.dtype, loss.shape, self.sens))
        else:
            grads = self.grad_no_sens(self.network, self.weights)(*inputs)
        return loss, grads

    def _micro_batch(self, inputs: tuple[ms.Tensor, ...], i: int) -> tuple[ms.Tensor, ...]:
        """The i-th of `grad_accum` equal slices of every input's leading dimension."""
        return tuple([x[i * (x.shape[0] // self.grad_accum):(i + 1) * (x.shape[0] // self.grad_accum)]
                      for x in inputs])
