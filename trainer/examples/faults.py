"""Faults the examples can inject for tests and demos, as a flaky device would make them.

`--corrupt-grad RANK:STEP`: rank RANK's own gradients of step STEP are multiplied by CORRUPTION_FACTOR, once,
in the first generation only: what a device that computes wrong for a moment (silent data corruption) does
to a step. The loss is left as it was: the fault is in the backward pass. A replay of the step computes it
right (`trainer.runtime.step_replay`), so trainerd blames the device, not the batch.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import mindspore as ms
from mindspore import nn, ops
from mindspore.train import Callback, RunContext

CORRUPTION_FACTOR = 1e4


@dataclass(frozen=True)
class GradientCorruption:
    """Where `--corrupt-grad RANK:STEP` strikes."""

    rank: int
    step: int

    @classmethod
    def parse(cls, text: str) -> GradientCorruption:
        """For argparse: `RANK:STEP`, a rank of at least 0 and a step of at least 1."""
        try:
            rank, step = (int(part) for part in text.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not RANK:STEP") from None
        if rank < 0 or step < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: the rank must be at least 0 and the step at least 1")
        return cls(rank, step)

    def strikes(self, rank: int | None, generation: int, step: int) -> bool:
        """Whether it strikes this rank's step `step`: in trainerd's first generation (1), or by hand (0)."""
        return generation <= 1 and rank == self.rank and step == self.step


class GradientFault(nn.Cell):
    """`fault(x) -> x` in the forward pass; after `arm(passes)`, the gradient flowing back through it in the
    next `passes` forward passes is multiplied by CORRUPTION_FACTOR, then it disarms itself (inside the step: a
    replay of the same step runs clean). Put it on the network's output: every gradient of the step is then
    scaled. A step computed with `value_and_grad` passes forward once per micro batch; one computed as
    `nn.TrainOneStepCell` computes it (the loss, then the network again under the gradient) twice.

    The forward value is x exactly (x - stop_gradient(x) is 0); its gradient is 1 + (factor - 1) while armed."""

    def __init__(self) -> None:
        super().__init__(auto_prefix=False)
        self.armed = ms.Parameter(ms.Tensor(0.0, ms.float32), name="test_fault.armed", requires_grad=False)
        self._extra = ms.Tensor(CORRUPTION_FACTOR - 1.0, ms.float32)

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        scale = ops.cast(self.armed > 0, ms.float32) * self._extra
        ops.assign(self.armed, ops.maximum(self.armed - 1, ops.zeros_like(self.armed)))
        return x + (x - ops.stop_gradient(x)) * ops.cast(scale, x.dtype)

    def arm(self, passes: int = 1) -> None:
        """Between steps: the next `passes` forward passes' gradients are corrupted."""
        self.armed.set_data(ms.Tensor(float(passes), ms.float32))


class CorruptGradientAt(Callback):
    """For Model.train with GuardedTrainOneStepCell: arms `fault` before the step `corruption` strikes
    (`cur_step_num` is the global step once TrainerdCallback, earlier in the list, has begun), for the cell's
    two forward passes of its first micro batch."""

    def __init__(self, fault: GradientFault, corruption: GradientCorruption, rank: int | None,
                 generation: int) -> None:
        super().__init__()
        self._fault, self._corruption, self._rank, self._generation = fault, corruption, rank, generation

    def on_train_step_begin(self, run_context: RunContext) -> None:
        if self._corruption.strikes(self._rank, self._generation, run_context.original_args().cur_step_num):
            self._fault.arm(passes=2)


class WithGradientFault(nn.Cell):
    """`network` followed by a GradientFault on its output; the parameters keep their names."""

    def __init__(self, network: nn.Cell) -> None:
        super().__init__(auto_prefix=False)
        self.network = network
        self.fault = GradientFault()

    def construct(self, *inputs: ms.Tensor) -> ms.Tensor:
        return self.fault(self.network(*inputs))
