"""The loss-scale overflow check on CPU (CPU/test-only; see the package docstring)."""

from __future__ import annotations

from typing import Any


def patch_overflow_check() -> None:
    """TrainOneStepWithLossScaleCell (MindFormers' MFTrainOneStepCell derives from it) reads NPU float-status
    registers, or on GPU the FloatStatus kernel; CPU has neither. Replace the check with the same rule in ops
    CPU has: overflow when any gradient holds a non-finite value, summed over devices when distributed.
    Call it only in processes that train on CPU: the replacement is compiled into the graph."""
    from mindspore import ops
    from mindspore.common import dtype as mstype
    from mindspore.nn.wrap.loss_scale import TrainOneStepWithLossScaleCell

    not_finite = ops.MultitypeFuncGraph("not_finite")

    @not_finite.register("Tensor")
    def _(grad: Any) -> Any:
        return ops.cast(ops.logical_not(ops.isfinite(grad).all()), mstype.float32)

    def get_overflow_status(self: Any, status: Any, compute_output: Any) -> Any:
        return self._get_distributed_overflow_status_on_infnan_mode(not_finite, compute_output)

    TrainOneStepWithLossScaleCell.get_overflow_status = get_overflow_status
