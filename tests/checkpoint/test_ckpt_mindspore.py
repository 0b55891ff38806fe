"""MindSpore at the edges, with real MindSpore (a missing MindSpore fails these tests):
a Cell and its optimizer saved at N ranks and restored at M, bfloat16, the export loaded by
`mindspore.load_checkpoint`, and MindSpore-native tensor-parallel checkpoints imported and resharded.
"""

from __future__ import annotations

import json
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn
from mindspore.parallel._tensor import _load_tensor
from mindspore.train import node_strategy_pb2

from trainer.checkpoint import (
    CheckpointMeta,
    CheckpointWriter,
    export_safetensors,
    import_native,
    load_checkpoint,
    load_latest,
    write_resharded,
)
from trainer.checkpoint.mindspore_io import load_numpy_into, parameters_to_numpy


def _mlp() -> nn.Cell:
    return nn.SequentialCell(nn.Dense(64, 256), nn.ReLU(), nn.Dense(256, 10))


class _Trainer:
    """A 64→256→10 MLP with Adam, trained on a fixed batch so two copies can be compared step by step."""

    def __init__(self, seed: int) -> None:
        ms.set_seed(seed)
        self.net = _mlp()
        self.optimizer = nn.Adam(self.net.trainable_params(), learning_rate=1e-2)
        loss = nn.WithLossCell(self.net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"))
        self.step = nn.TrainOneStepCell(loss, self.optimizer)
        rng = np.random.default_rng(0)
        self.x = ms.Tensor(rng.standard_normal((32, 64)).astype(np.float32))
        self.y = ms.Tensor(rng.integers(0, 10, 32).astype(np.int32))

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.step(self.x, self.y)

    def state(self) -> dict[str, np.ndarray]:
        return {name: array.copy() for name, array in parameters_to_numpy(self.net, self.optimizer).items()}


def _save(root: Path, state: dict[str, np.ndarray], world_size: int, step: int = 3) -> Path:
    writers = [CheckpointWriter(root, rank, world_size) for rank in range(world_size)]
    for writer in writers:
        writer.save_async(CheckpointMeta(step, step * 32, 0), state)
    results = [writer.wait() for writer in writers]
    for writer in writers:
        writer.close()
    return results[0]


def _bits(state: dict[str, np.ndarray]) -> dict[str, bytes]:
    return {name: array.tobytes() for name, array in state.items()}


def test_cell_and_optimizer_restored_at_another_world_size_train_on_identically(tmp_path: Path) -> None:
    original = _Trainer(seed=1)
    original.train(3)
    saved = original.state()
    assert {"global_step", "moment1.0.weight", "moment2.2.bias", "0.weight"} <= set(saved)
    assert np.any(saved["moment1.0.weight"] != 0)
    _save(tmp_path, parameters_to_numpy(original.net, original.optimizer), world_size=2)

    restored = _Trainer(seed=2)
    assert _bits(restored.state()) != _bits(saved)
    tensors, manifest = load_latest(tmp_path, rank=2, world_size=3)
    load_numpy_into(tensors, restored.net, restored.optimizer)
    assert manifest.step == 3 and _bits(restored.state()) == _bits(saved)

    original.train(2)
    restored.train(2)
    assert _bits(restored.state()) == _bits(original.state())


def test_bfloat16_parameters_round_trip_and_export(tmp_path: Path) -> None:
    class Scaled(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            values = np.linspace(-3, 3, 6 * 1000, dtype=np.float32).reshape(6, 1000)
            self.scale = ms.Parameter(ms.Tensor(values, ms.bfloat16), name="scale")

    cell = Scaled()
    state = parameters_to_numpy(cell)
    assert state["scale"].dtype.name == "bfloat16"
    step_dir = _save(tmp_path / "ckpt", state, world_size=3)
    tensors, _ = load_checkpoint(step_dir, 0, 2)
    target = Scaled()
    target.scale.set_data(ms.Tensor(np.zeros((6, 1000), np.float32), ms.bfloat16))
    load_numpy_into(tensors, target)
    assert target.scale.dtype == ms.bfloat16
    assert target.scale.asnumpy().view(np.uint16).tobytes() == state["scale"].view(np.uint16).tobytes()

    export_safetensors(step_dir, tmp_path / "model.safetensors")
    loaded = ms.load_checkpoint(str(tmp_path / "model.safetensors"), format="safetensors")
    assert loaded["scale"].dtype == ms.bfloat16
    assert loaded["scale"].asnumpy().view(np.uint16).tobytes() == state["scale"].view(np.uint16).tobytes()


def test_export_loads_into_the_network_with_mindspore_load_checkpoint(tmp_path: Path) -> None:
    trained = _Trainer(seed=3)
    trained.train(2)
    saved = trained.state()
    step_dir = _save(tmp_path / "ckpt", saved, world_size=2)
    export_safetensors(step_dir, tmp_path / "model.safetensors")

    fresh = _mlp()
    params = ms.load_checkpoint(str(tmp_path / "model.safetensors"), format="safetensors")
    not_loaded, _ = ms.load_param_into_net(fresh, params)
    assert not_loaded == []
    for param in fresh.get_parameters():
        assert param.asnumpy().tobytes() == saved[param.name].tobytes(), param.name
    assert params["moment1.0.weight"].asnumpy().tobytes() == saved["moment1.0.weight"].tobytes()


# --- MindSpore-native distributed checkpoints -------------------------------------------------------

# name -> (global tensor, device matrix, tensor map); tensor map entries count device axes from the right.
Layouts = dict[str, tuple[np.ndarray, list[int], list[int]]]
_RNG = np.random.default_rng(5)
_TWO_DEVICES: Layouts = {
    "dense.weight": (_RNG.standard_normal((8, 12)).astype(np.float32), [2], [-1, 0]),  # split on dim 1
    "dense2.weight": (_RNG.standard_normal((6, 4)).astype(np.float32), [2], [0, -1]),  # split on dim 0
}
_FOUR_DEVICES: Layouts = {
    "grid": (_RNG.standard_normal((4, 6)).astype(np.float32), [2, 2], [1, 0]),  # both dims split
    "columns": (_RNG.standard_normal((3, 8)).astype(np.float16), [2, 2], [-1, 0]),  # dim 1 split, replicated twice
}
_REPLICATED = {"bias": _RNG.standard_normal(5).astype(np.float32), "global_step": np.array([7], np.int32)}


def _strategy_protobuf(layouts: Layouts, path: Path) -> None:
    strategy = node_strategy_pb2.ParallelStrategyMap(current_stage=0)
    for name, (_, dev_matrix, tensor_map) in layouts.items():
        item = strategy.parallel_layout_item.add(param_name=name)
        item.parallel_layouts.dev_matrix.add().dim.extend(dev_matrix)
        item.parallel_layouts.tensor_map.add().dim.extend(tensor_map)
        item.parallel_layouts.param_split_shape.add()
        item.parallel_layouts.indices_offset.add()
        item.parallel_layouts.field = 0
        item.parallel_layouts.opt_weight_shard_step = 0
        item.parallel_layouts.opt_weight_shard_size = 0
    path.write_bytes(strategy.SerializeToString())


def _strategy_json(layouts: Layouts, path: Path) -> None:
    items = {
        name: {"dev_matrix": dev_matrix, "tensor_map": tensor_map, "param_split_shape": [], "indices_offset": [],
               "field": 0, "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}
        for name, (_, dev_matrix, tensor_map) in layouts.items()
    }
    path.write_text(json.dumps({"current_stage": 0, "parallel_strategy_item": {}, "parallel_layout_item": items}))


def _numpy_slice(full: np.ndarray, dev_matrix: list[int], tensor_map: list[int], rank: int) -> np.ndarray:
    """Rank `rank`'s slice by numpy: its coordinate in the device matrix picks the block of each split dimension."""
    coordinate = np.unravel_index(rank, dev_matrix)
    block = full
    for dim, axis in enumerate(tensor_map):
        if axis != -1:
            parts = dev_matrix[len(dev_matrix) - 1 - axis]
            block = np.split(block, parts, axis=dim)[coordinate[len(dev_matrix) - 1 - axis]]
    return block


def _native_checkpoint(directory: Path, layouts: Layouts) -> None:
    """rank_i/net.safetensors written by MindSpore itself, each holding rank i's slices."""
    device_num = int(np.prod(next(iter(layouts.values()))[1]))
    for rank in range(device_num):
        params = []
        for name, (full, dev_matrix, tensor_map) in layouts.items():
            block = _numpy_slice(full, dev_matrix, tensor_map, rank)
            oracle = _load_tensor(ms.Tensor(full), dev_matrix, tensor_map, None, rank)  # MindSpore's own slicing
            assert np.array_equal(block, oracle)
            params.append({"name": name, "data": ms.Tensor(block)})
        params += [{"name": name, "data": ms.Tensor(value)} for name, value in _REPLICATED.items()]
        (directory / f"rank_{rank}").mkdir(parents=True)
        ms.save_checkpoint(params, str(directory / f"rank_{rank}" / "net.safetensors"), format="safetensors")


@pytest.mark.parametrize(
    ("layouts", "strategy_format", "world_size"),
    [(_TWO_DEVICES, "protobuf", 4), (_TWO_DEVICES, "json", 4), (_FOUR_DEVICES, "protobuf", 3)],
    ids=["2-devices-protobuf-to-4", "2-devices-json-to-4", "2x2-mesh-protobuf-to-3"],
)
def test_native_tensor_parallel_checkpoint_reshards_exactly(
    tmp_path: Path, layouts: Layouts, strategy_format: str, world_size: int
) -> None:
    _native_checkpoint(tmp_path / "native", layouts)
    strategy = tmp_path / ("strategy.json" if strategy_format == "json" else "strategy.ckpt")
    (_strategy_json if strategy_format == "json" else _strategy_protobuf)(layouts, strategy)

    native = import_native(tmp_path / "native", strategy)
    assert {name: layout.shape for name, layout in native.tensors.items()} == {
        **{name: full.shape for name, (full, _, _) in layouts.items()},
        **{name: value.shape for name, value in _REPLICATED.items()},
    }
    step_dir = write_resharded(native.directory, native.tensors, CheckpointMeta(0, 0, 0), tmp_path / "out", world_size)

    shard_dims = {name: 1 for name, (full, _, _) in layouts.items()}
    for rank in range(world_size):
        whole, _ = load_checkpoint(step_dir, rank, world_size)
        sharded, _ = load_checkpoint(step_dir, rank, world_size, shard_dims)
        for name, (full, _, _) in layouts.items():
            assert whole[name].tobytes() == full.tobytes()
            column_block = np.array_split(full, world_size, axis=1)[rank]
            assert sharded[name].shape == column_block.shape and sharded[name].tobytes() == column_block.tobytes()
        for name, value in _REPLICATED.items():
            assert whole[name].tobytes() == value.tobytes() and whole[name].dtype == value.dtype


def test_native_dimension_split_over_two_device_axes_is_imported(tmp_path: Path) -> None:
    # Protobuf only: one TensorMap per tensor dimension, dimension 0 split over both axes of a 2x2 matrix.
    full = _RNG.standard_normal((8, 3)).astype(np.float32)
    for rank in range(4):
        # MindSpore expands dimension 0 into (2, 4) mapped to axes (1, 0), then slices.
        block = _load_tensor(ms.Tensor(full.reshape(2, 4, 3)), [2, 2], [1, 0, -1], None, rank).reshape(2, 3)
        (tmp_path / "native" / f"rank_{rank}").mkdir(parents=True)
        ms.save_checkpoint([{"name": "w", "data": ms.Tensor(block)}],
                           str(tmp_path / "native" / f"rank_{rank}" / "net.safetensors"), format="safetensors")
    strategy = node_strategy_pb2.ParallelStrategyMap(current_stage=0)
    layout = strategy.parallel_layout_item.add(param_name="w").parallel_layouts
    layout.dev_matrix.add().dim.extend([2, 2])
    layout.tensor_map.add().dim.extend([1, 0])
    layout.tensor_map.add().dim.extend([-1])
    layout.field, layout.opt_weight_shard_step, layout.opt_weight_shard_size = 0, 0, 0
    (tmp_path / "strategy.ckpt").write_bytes(strategy.SerializeToString())

    native = import_native(tmp_path / "native", tmp_path / "strategy.ckpt")
    step_dir = write_resharded(native.directory, native.tensors, CheckpointMeta(0, 0, 0), tmp_path / "out", 3)
    assert load_checkpoint(step_dir, 1, 3)[0]["w"].tobytes() == full.tobytes()
