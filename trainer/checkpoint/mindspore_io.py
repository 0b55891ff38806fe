"""MindSpore at the edge: the parameters of Cells (a network, its optimizer's moments and step) as numpy
arrays keyed by parameter name, and back. The only module of the package that imports MindSpore; importing
it also gives numpy its `bfloat16` dtype, which MindSpore registers.

Names are MindSpore's parameter names (`fc1.weight`, `moment1.fc1.weight`, `global_step`, ...), the names
`mindspore.save_checkpoint` uses, so an exported checkpoint loads with `mindspore.load_checkpoint`.
"""

from __future__ import annotations

from collections.abc import Mapping

import mindspore as ms
import numpy as np

from trainer.checkpoint.errors import CheckpointError


def _parameters(cells: tuple[ms.nn.Cell, ...]) -> dict[str, ms.Parameter]:
    """Every parameter of the cells once; an optimizer lists the network's parameters again, which is fine."""
    found: dict[str, ms.Parameter] = {}
    for cell in cells:
        for param in cell.get_parameters():
            known = found.setdefault(param.name, param)
            if known is not param:
                raise CheckpointError(f"two different parameters are named '{param.name}'")
    return found


def parameters_to_numpy(*cells: ms.nn.Cell) -> dict[str, np.ndarray]:
    """The parameters of the cells as numpy arrays (bfloat16 stays bfloat16).

    On CPU the arrays share memory with the parameters: hand them to `CheckpointWriter.save_async`, which
    copies them before it returns, and do not keep them across a training step.
    """
    return {name: param.asnumpy() for name, param in _parameters(cells).items()}


def load_numpy_into(state: Mapping[str, np.ndarray], *cells: ms.nn.Cell) -> None:
    """Sets every parameter of the cells from `state`, bit for bit. Raises CheckpointError, before changing
    anything, when a parameter is missing or its shape or dtype differs. Entries no cell has are ignored.
    """
    parameters = _parameters(cells)
    missing = sorted(set(parameters) - set(state))
    if missing:
        raise CheckpointError(f"the checkpoint lacks {len(missing)} parameters, e.g. {missing[:5]}")
    for name, param in parameters.items():
        array = state[name]
        expected = np.dtype(ms.dtype_to_nptype(param.dtype))
        if array.shape != tuple(param.shape) or array.dtype != expected:
            raise CheckpointError(
                f"parameter '{name}' is {expected} {list(param.shape)}, "
                f"the checkpoint holds {array.dtype} {list(array.shape)}"
            )
    for name, param in parameters.items():
        param.set_data(ms.Tensor(state[name]))
