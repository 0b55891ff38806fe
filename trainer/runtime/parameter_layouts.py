"""Which part of each parameter of the train network this rank holds, read from MindSpore at train begin.

In data parallel every rank holds every parameter whole: `parameter_layouts` returns {} and checkpoints are
saved as before. Under semi-auto or auto parallel (tensor and optimizer parallel) MindSpore cuts parameters
when it compiles the train network and records how in the network's `parameter_layout_dict`; each entry is
translated by `trainer.checkpoint.parallel_layout` into the region every rank holds, so that each rank saves
its own slice with the global shape and offsets. Parameters the dict does not name are whole on every rank.

Model.train compiles at its first step, after the callbacks' `on_train_begin`. When the dict is still empty
there (the script did not call `Model.build`), the train network is compiled here first, on zeros shaped like
the dataset's columns, as `Model.build` does with a real batch; the first step then reuses that graph. Either
way the parameters are already this rank's slices when a resume loads into them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore.communication import get_process_group_ranks

from trainer.checkpoint.errors import UnsupportedLayout
from trainer.checkpoint.parallel_layout import from_parameter_layout
from trainer.checkpoint.sharding import ShardedTensor

SHARDING_MODES = ("semi_auto_parallel", "auto_parallel")

GroupRanks = Callable[[str], Sequence[int]]


def parameter_layouts(
    network: ms.nn.Cell,
    dataset: Any,
    rank: int,
    world_size: int,
    group_ranks: GroupRanks = get_process_group_ranks,
) -> dict[str, ShardedTensor]:
    """Parameter name -> the regions every rank holds, for the parameters MindSpore's layout cuts; {} in data
    parallel. `group_ranks` gives the world ranks of a communication group in group order. Raises
    UnsupportedLayout, in one line naming the parameter, for a layout the checkpoint cannot represent exactly.
    """
    layout_dict = network.parameter_layout_dict
    if not layout_dict and ms.get_auto_parallel_context("parallel_mode") in SHARDING_MODES:
        _compile(network, dataset)
        layout_dict = network.parameter_layout_dict
    if not layout_dict:
        return {}
    stages = ms.get_auto_parallel_context("pipeline_stages")
    if stages > 1:
        raise UnsupportedLayout(f"pipeline parallel ({stages} stages) cannot be represented")
    parameters = {param.name: param for param in network.get_parameters()}
    sharded = {}
    for name, entry in layout_dict.items():
        param = parameters.get(name)
        if param is None:  # a layout of something the network does not save
            continue
        group = entry[5] if isinstance(entry, (list, tuple)) and len(entry) > 5 else ""
        layout, shape = from_parameter_layout(
            name, entry, tuple(param.shape), rank, tuple(group_ranks(group)) if group else ()
        )
        try:
            sharded[name] = layout.sharded(shape, world_size)
        except UnsupportedLayout as exc:
            raise UnsupportedLayout(f"parameter '{name}': {exc}") from None
    return sharded


def _compile(network: ms.nn.Cell, dataset: Any) -> None:
    """Compile `network` for batches of `dataset`, which MindSpore lays its parameters out for."""
    shapes, types = dataset.output_shapes(), dataset.output_types()
    network.compile(*(ms.Tensor(np.zeros(shape, dtype)) for shape, dtype in zip(shapes, types)))
