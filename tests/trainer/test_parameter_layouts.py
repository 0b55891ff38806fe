"""parameter_layouts in one process with a real MindSpore cell whose parameter_layout_dict is set as a compile
under semi-auto parallel would set it (this CPU cannot compile semi-auto parallel itself): the regions each rank
holds, the optimizer shard group asked of the communication layer, and the refusals."""

from __future__ import annotations

from collections.abc import Iterator

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from trainer.checkpoint.errors import UnsupportedLayout
from trainer.checkpoint.layout import Region
from trainer.runtime.parameter_layouts import parameter_layouts


class Net(nn.Cell):
    """Rank 1 of 4 under dev_matrix [2, 2]: `w` (8, 6) has its columns cut over the inner axis and its rows cut
    by optimizer parallel over the outer one; `b` is whole on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.w = ms.Parameter(ms.Tensor(np.zeros((4, 3), np.float32)), name="w")
        self.b = ms.Parameter(ms.Tensor(np.zeros(3, np.float32)), name="b")


@pytest.fixture
def net() -> Net:
    cell = Net()
    cell.parameter_layout_dict = {
        "w": ([2, 2], [-1, 0], [8, 3], 0, True, "2-opt-group"),
        "accu_grads.w": ([2, 2], [-1, 0], [8, 3], 0, True, ""),  # a layout of something the cell does not hold
    }
    return cell


@pytest.fixture
def stand_alone() -> Iterator[None]:
    yield
    ms.reset_auto_parallel_context()


def test_each_rank_holds_the_region_its_layout_and_optimizer_group_give_it(net: Net, stand_alone: None) -> None:
    asked = []

    def group_ranks(group: str) -> list[int]:
        asked.append(group)
        return [1, 3]  # rank 1's replicas, in rank order

    sharded = parameter_layouts(net, None, 1, 4, group_ranks)
    assert asked == ["2-opt-group"] and set(sharded) == {"w"}
    assert sharded["w"].shape == (8, 6)
    assert sharded["w"].regions == (Region((0, 0), (4, 3)), Region((0, 3), (4, 3)),
                                    Region((4, 0), (4, 3)), Region((4, 3), (4, 3)))


def test_data_parallel_has_no_cut_parameters(stand_alone: None) -> None:
    assert parameter_layouts(Net(), None, 0, 2, lambda group: []) == {}


def test_pipeline_stages_and_foreign_groups_are_refused(net: Net, stand_alone: None) -> None:
    with pytest.raises(UnsupportedLayout, match="ranks \\[1, 2\\], but its layout puts rank 1 with ranks \\[1, 3\\]"):
        parameter_layouts(net, None, 1, 4, lambda group: [1, 2])
    with pytest.raises(UnsupportedLayout, match="covers 4 ranks but the job has 8"):
        parameter_layouts(net, None, 1, 8, lambda group: [1, 3])
    ms.set_auto_parallel_context(pipeline_stages=2)
    with pytest.raises(UnsupportedLayout, match="pipeline parallel \\(2 stages\\) cannot be represented"):
        parameter_layouts(net, None, 1, 4, lambda group: [1, 3])
