"""Import a MindSpore-native distributed checkpoint into the layout model, so that it reshards like ours.

The input is what a (tensor-)parallel MindSpore job saves: `rank_{i}/` directories holding each rank's
safetensors file (the lexicographically last `*.safetensors` of each, as `mindspore.transform_checkpoints`
picks), and the strategy file (`ParallelStrategyMap`, protobuf, or JSON with the same fields). For every
parameter the strategy gives a device matrix, a tensor map and the optimizer sharding saved apart
(`opt_weight_shard_*`); the file of rank i holds the region `parallel_layout` gives rank i. Parameters the
strategy does not name are whole on every rank and taken from rank 0. Only headers are read here; the data
stays where it is and is read through the usual read plan.

Not supported, and refused with a clear error (`parallel_layout.UnsupportedLayout`): uneven splits
(`param_split_shape`), embedding fields and pipeline stages.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from safetensors import SafetensorError, safe_open

from trainer.checkpoint.errors import CheckpointError, CorruptCheckpoint, UnsupportedLayout
from trainer.checkpoint.json_fields import MAX_JSON_BYTES, MAX_NDIM
from trainer.checkpoint.layout import Chunk, Region, TensorLayout
from trainer.checkpoint.parallel_layout import ParallelLayout, from_strategy

_F = descriptor_pb2.FieldDescriptorProto
_REPEATED, _OPTIONAL = _F.LABEL_REPEATED, _F.LABEL_OPTIONAL
# The part of MindSpore's node_strategy.proto (package mindspore.straspb) that describes tensor layouts.
_STRATEGY_MESSAGES: dict[str, list[tuple[str, int, int, int, str | None]]] = {
    "DevMatrix": [("dim", 1, _F.TYPE_UINT32, _REPEATED, None)],
    "TensorMap": [("dim", 1, _F.TYPE_INT32, _REPEATED, None)],
    "ParamSplitShape": [("dim", 1, _F.TYPE_INT64, _REPEATED, None)],
    "IndicesOffset": [("dim", 1, _F.TYPE_INT64, _REPEATED, None)],
    "ParallelLayouts": [
        ("dev_matrix", 1, _F.TYPE_MESSAGE, _REPEATED, "DevMatrix"),
        ("tensor_map", 2, _F.TYPE_MESSAGE, _REPEATED, "TensorMap"),
        ("param_split_shape", 3, _F.TYPE_MESSAGE, _REPEATED, "ParamSplitShape"),
        ("indices_offset", 4, _F.TYPE_MESSAGE, _REPEATED, "IndicesOffset"),
        ("field", 5, _F.TYPE_INT32, _OPTIONAL, None),
        ("opt_weight_shard_step", 6, _F.TYPE_INT32, _OPTIONAL, None),
        ("opt_weight_shard_size", 7, _F.TYPE_INT32, _OPTIONAL, None),
    ],
    "ParallelLayoutItem": [
        ("param_name", 1, _F.TYPE_STRING, _OPTIONAL, None),
        ("parallel_layouts", 2, _F.TYPE_MESSAGE, _OPTIONAL, "ParallelLayouts"),
    ],
    "ParallelStrategyMap": [
        ("current_stage", 1, _F.TYPE_UINT32, _OPTIONAL, None),
        ("parallel_layout_item", 3, _F.TYPE_MESSAGE, _REPEATED, "ParallelLayoutItem"),
    ],
}
_PACKAGE = "mindspore.straspb"
_MAX_DEVICES = 1 << 20


@functools.cache
def _strategy_map_class() -> Any:
    proto = descriptor_pb2.FileDescriptorProto(name="node_strategy_layouts.proto", package=_PACKAGE, syntax="proto2")
    for message_name, fields in _STRATEGY_MESSAGES.items():
        message = proto.message_type.add(name=message_name)
        for name, number, kind, label, type_name in fields:
            field = message.field.add(name=name, number=number, type=kind, label=label)
            if type_name:
                field.type_name = f".{_PACKAGE}.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.ParallelStrategyMap"))


def _strategy(
    name: str,
    dev_matrix: list[int],
    tensor_map: list[list[int]],
    split_shape: list[int],
    field: int,
    opt_step: int,
    opt_size: int,
) -> ParallelLayout:
    where = f"strategy for '{name}'"
    if not dev_matrix or len(dev_matrix) > MAX_NDIM or not all(1 <= d <= _MAX_DEVICES for d in dev_matrix):
        raise CorruptCheckpoint(f"{where}: device matrix {dev_matrix[:MAX_NDIM]} is not valid")
    if len(tensor_map) > MAX_NDIM or not all(-1 <= a < len(dev_matrix) for axes in tensor_map for a in axes):
        raise CorruptCheckpoint(f"{where}: tensor map {tensor_map[:MAX_NDIM]} does not fit device matrix {dev_matrix}")
    return from_strategy(name, dev_matrix, tensor_map, split_shape, field, opt_step, opt_size)


def _int_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise CorruptCheckpoint(f"{where} must be a list of integers")
    return value


def _read_json_strategy(raw: bytes, where: str) -> dict[str, ParallelLayout]:
    try:
        content = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpoint(f"{where} is not valid JSON: {exc}") from exc
    items = content.get("parallel_layout_item", {}) if isinstance(content, dict) else None
    if not isinstance(items, dict):
        raise CorruptCheckpoint(f"{where}: 'parallel_layout_item' must map parameter names to layouts")
    strategies = {}
    for name, item in items.items():
        if not isinstance(item, dict):
            raise CorruptCheckpoint(f"{where}: layout of '{name}' must be an object")
        numbers = {key: item.get(key, 0) for key in ("field", "opt_weight_shard_step", "opt_weight_shard_size")}
        _int_list(list(numbers.values()), f"{where}: layout of '{name}'")
        strategies[name] = _strategy(
            name,
            _int_list(item.get("dev_matrix"), f"{where}: dev_matrix of '{name}'"),
            [[a] for a in _int_list(item.get("tensor_map"), f"{where}: tensor_map of '{name}'")],
            _int_list(item.get("param_split_shape", []), f"{where}: param_split_shape of '{name}'"),
            numbers["field"],
            numbers["opt_weight_shard_step"],
            numbers["opt_weight_shard_size"],
        )
    return strategies


def _read_protobuf_strategy(raw: bytes, where: str) -> dict[str, ParallelLayout]:
    strategy_map = _strategy_map_class()()
    try:
        strategy_map.ParseFromString(raw)
    except DecodeError as exc:
        raise CorruptCheckpoint(f"{where} is not a ParallelStrategyMap protobuf (use a .json name for JSON)") from exc
    strategies = {}
    for item in strategy_map.parallel_layout_item:
        layout = item.parallel_layouts
        if len(layout.dev_matrix) != 1:
            raise CorruptCheckpoint(
                f"{where}: layout of '{item.param_name}' has {len(layout.dev_matrix)} device matrices"
            )
        # One TensorMap per tensor dimension when a dimension may be split over several axes; else one for all.
        tensor_map = (
            [list(m.dim) for m in layout.tensor_map if list(m.dim)]
            if len(layout.tensor_map) > 1
            else [[a] for a in layout.tensor_map[0].dim] if layout.tensor_map else []
        )
        strategies[item.param_name] = _strategy(
            item.param_name,
            list(layout.dev_matrix[0].dim),
            tensor_map,
            [d for shape in layout.param_split_shape for d in shape.dim],
            layout.field,
            layout.opt_weight_shard_step,
            layout.opt_weight_shard_size,
        )
    return strategies


def read_strategy_file(path: Path) -> dict[str, ParallelLayout]:
    """Parameter name -> strategy, from a `ParallelStrategyMap` file: JSON when named `*.json`, else protobuf."""
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise CorruptCheckpoint(f"strategy file {path} is {size} bytes, more than {MAX_JSON_BYTES}")
        raw = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read strategy file {path}: {exc.strerror}") from exc
    where = f"strategy file {path.name}"
    return _read_json_strategy(raw, where) if path.suffix == ".json" else _read_protobuf_strategy(raw, where)


@dataclass(frozen=True)
class NativeCheckpoint:
    """A MindSpore distributed checkpoint seen through the layout model; chunk files are relative to `directory`."""

    directory: Path
    device_num: int
    tensors: dict[str, TensorLayout]


def _rank_file(directory: Path, rank: int) -> str:
    rank_dir = directory / f"rank_{rank}"
    files = sorted(p.name for p in rank_dir.glob("*.safetensors") if p.is_file()) if rank_dir.is_dir() else []
    if not files:
        raise CheckpointError(f"{rank_dir} holds no .safetensors file")
    return f"rank_{rank}/{files[-1]}"


def safetensors_headers(directory: Path, name: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """key -> (dtype, shape) of the safetensors file `directory / name`, read from its header only."""
    try:
        with safe_open(directory / name, framework="numpy") as f:
            return {key: (f.get_slice(key).get_dtype(), tuple(f.get_slice(key).get_shape())) for key in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise CorruptCheckpoint(f"{name} is not a readable safetensors file: {exc}") from exc


def import_native(directory: Path, strategy_file: Path) -> NativeCheckpoint:
    """The layout of every parameter of the checkpoint under `directory`, validated for exact coverage."""
    strategies = read_strategy_file(strategy_file)
    device_nums = {s.device_num for s in strategies.values()}
    if len(device_nums) > 1:
        raise CheckpointError(f"strategy file {strategy_file.name} mixes device counts {sorted(device_nums)}")
    rank_dirs = [p for p in directory.glob("rank_*") if p.is_dir()]
    device_num = device_nums.pop() if device_nums else len(rank_dirs)
    if len(rank_dirs) != device_num:
        raise CheckpointError(
            f"{directory} has {len(rank_dirs)} rank directories but the strategy describes {device_num} devices "
            "(pipeline-parallel checkpoints are not supported)"
        )
    files = [_rank_file(directory, rank) for rank in range(device_num)]
    headers = [safetensors_headers(directory, name) for name in files]
    tensors = {}
    for name, (dtype, slice_shape) in headers[0].items():
        strategy = strategies.get(name)
        if strategy is None:
            tensors[name] = TensorLayout(dtype, slice_shape, (Chunk(Region.full(slice_shape), files[0], name),))
            continue
        try:
            sharded = strategy.sharded(strategy.global_shape(slice_shape), device_num)
        except UnsupportedLayout as exc:
            raise UnsupportedLayout(f"parameter '{name}': {exc}") from None
        chunks: dict[Region, Chunk] = {}
        for rank, (header, region) in enumerate(zip(headers, sharded.regions)):
            if header.get(name) != (dtype, slice_shape):
                raise CheckpointError(
                    f"{files[rank]} does not hold '{name}' as {dtype} {list(slice_shape)} like rank 0"
                )
            chunks.setdefault(region, Chunk(region, files[rank], name))
        tensors[name] = TensorLayout(dtype, sharded.shape, tuple(chunks.values()))
    for name, layout in tensors.items():
        layout.validate(name)
    return NativeCheckpoint(directory, device_num, tensors)
