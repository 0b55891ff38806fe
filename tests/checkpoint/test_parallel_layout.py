"""MindSpore parallel layouts as the regions ranks hold (`trainer.checkpoint.parallel_layout`), checked against
numpy slicing and MindSpore's own functions: every layout's regions tile the tensor exactly; each rank's region
is the slice MindSpore gives it (`_get_tensor_slice_index`, `_load_tensor`, and for optimizer parallel the
replica groups of `get_parameter_redundancy`); entries shaped like `parameter_layout_dict`'s translate to the
same layouts; a checkpoint saved from the ranks' slices through the real writer loads bit-exactly at 1, 2 and 3
ranks; what cannot be represented is refused in one line.

No test takes `parameter_layout_dict` from a compiled network: MindSpore 2.10 compiles semi-auto parallel only
for Ascend and GPU. On this CPU build, compiling a `semi_auto_parallel` network answers "RuntimeError: Invalid
communication backend: CPU for semi_auto_parallel/auto_parallel mode, currently only support Ascend/GPU
backend." (`step_parallel_utils.cc` GetCommInfo), with and without MS_SIMULATION_LEVEL=0/1; `device_target=
"Ascend"` answers "Unsupported device target Ascend. This process only supports one of the ['CPU']"; and
`init()` under MS_SIMULATION_LEVEL refuses "Dryrun is not supported on CPU device for a distributed job."
The entries here are built as `GetParameterLayoutFromGraph` builds them.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np
import pytest
from mindspore.parallel._tensor import (
    _expand_layout,
    _get_tensor_slice_index,
    _get_tensor_strategy,
    _load_tensor,
)
from mindspore.train import node_strategy_pb2
from mindspore.train._utils import get_parameter_redundancy
from safetensors.numpy import save_file

from trainer.checkpoint import (
    CheckpointError,
    CheckpointMeta,
    CheckpointWriter,
    import_native,
    load_checkpoint,
    write_resharded,
)
from trainer.checkpoint.errors import UnsupportedLayout
from trainer.checkpoint.layout import Chunk, Region, TensorLayout, dtype_name
from trainer.checkpoint.manifest import read_manifest
from trainer.checkpoint.native_import import read_strategy_file
from trainer.checkpoint.parallel_layout import ParallelLayout, from_parameter_layout, from_strategy
from trainer.checkpoint.sharding import MIN_PIECE_BYTES, ShardedTensor, TensorSpec, write_assignment


@dataclass(frozen=True)
class Case:
    """A parameter of global `shape` laid out as MindSpore writes it: a device matrix, a tensor map (an int or a
    list of ints per dimension, axes counted from the right, -1 for none) and an optimizer shard size."""

    id: str
    shape: tuple[int, ...]
    dev_matrix: tuple[int, ...]
    tensor_map: tuple[Any, ...]
    opt: int = 1
    dtype: str = "float32"

    @property
    def device_num(self) -> int:
        return int(np.prod(self.dev_matrix))

    @property
    def nested(self) -> bool:
        return any(isinstance(axes, list) for axes in self.tensor_map)

    def layout(self) -> ParallelLayout:
        axes = [axes if isinstance(axes, list) else [axes] for axes in self.tensor_map]
        return ParallelLayout(self.dev_matrix, tuple(tuple(a for a in dim if a != -1) for dim in axes), self.opt)

    def full(self) -> np.ndarray:
        values = np.random.default_rng(len(self.id)).standard_normal(self.shape) * 1000
        return np.asarray(values, dtype=self.dtype)

    def tp_slice_shape(self) -> tuple[int, ...]:
        return tuple(n // k for n, k in zip(self.shape, _get_tensor_strategy(list(self.dev_matrix),
                                                                             list(self.tensor_map))))


CASES = [
    Case("tp2-dim0", (8, 6), (2,), (0, -1)),
    Case("tp2-dim1", (6, 8), (2,), (-1, 0)),
    Case("tp4-dim0", (8, 3), (4,), (0, -1)),
    Case("tp4-dim1", (3, 8), (4,), (-1, 0), dtype="float16"),
    Case("2x2-both-dims", (4, 6), (2, 2), (1, 0)),
    Case("2x2-both-dims-swapped", (4, 6), (2, 2), (0, 1), dtype="int64"),
    Case("2x2-dim1-replicated-over-outer-axis", (3, 8), (2, 2), (-1, 0)),
    Case("2x2-dim0-replicated-over-inner-axis", (4, 5), (2, 2), (1, -1)),
    Case("replicated-over-4", (5, 3), (4,), (-1, -1)),
    Case("bias-tp4", (8,), (4,), (0,)),
    Case("scalar-replicated", (), (4,), ()),
    Case("dim0-over-two-axes", (8, 3), (2, 2), ([1, 0], -1)),
    Case("dim0-over-two-axes-inner-first", (8, 3), (2, 2), ([0, 1], -1)),
    Case("opt4-replicated-weight", (8, 4), (4,), (-1, -1), opt=4),
    Case("opt2-of-4-replicas", (8, 4), (4,), (-1, -1), opt=2),
    Case("tp-dim1-opt-dim0", (8, 6), (2, 2), (-1, 0), opt=2),
    Case("tp-dim0-and-opt-dim0", (8, 3), (2, 2), (0, -1), opt=2),
    Case("3d-2x2x2-opt", (4, 3, 6), (2, 2, 2), (2, -1, 0), opt=2),
    Case("2x2x2-middle-axis-opt4", (8, 2), (2, 2, 2), (1, -1), opt=4, dtype="float16"),
]
FLAT = [case for case in CASES if case.shape and not case.nested]  # what MindSpore's strategy parser reads
by_id = pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
flat_by_id = pytest.mark.parametrize("case", FLAT, ids=[case.id for case in FLAT])


def _strategy_file(path: Path, cases: list[Case], opt_steps: dict[str, int] | None = None) -> Path:
    """A `ParallelStrategyMap` protobuf as MindSpore saves it (flat tensor maps only)."""
    strategy = node_strategy_pb2.ParallelStrategyMap(current_stage=0)
    for case in cases:
        item = strategy.parallel_layout_item.add(param_name=case.id)
        item.parallel_layouts.dev_matrix.add().dim.extend(case.dev_matrix)
        item.parallel_layouts.tensor_map.add().dim.extend(case.tensor_map)
        item.parallel_layouts.field = 0
        item.parallel_layouts.opt_weight_shard_step = (opt_steps or {}).get(case.id, 0)
        item.parallel_layouts.opt_weight_shard_size = case.opt if opt_steps and case.opt > 1 else 0
    path.write_bytes(strategy.SerializeToString())
    return path


def _mindspore_replicas(case: Case, tmp_path: Path) -> tuple[tuple[int, ...], ...]:
    """MindSpore's groups of ranks holding the same tensor-parallel slice, each in rank order."""
    path = _strategy_file(tmp_path / f"{case.id}-tp.ckpt", [case])
    return get_parameter_redundancy(str(path), initial_rank=0)[case.id]


def _mindspore_opt_step(case: Case, tmp_path: Path) -> int:
    """The opt_weight_shard_step MindSpore saves: the distance between rank 0's replicas."""
    replicas = next(group for group in _mindspore_replicas(case, tmp_path) if 0 in group)
    return (replicas[-1] - replicas[0]) // (len(replicas) - 1)


def _mindspore_groups(case: Case, tmp_path: Path) -> tuple[tuple[int, ...], ...]:
    """MindSpore's groups of ranks holding identical data, optimizer sharding included: for each slice's
    replicas r, groups r[i::opt] for i in range(opt), so group j holds part j % opt of its slice."""
    if case.opt == 1:
        return _mindspore_replicas(case, tmp_path)
    path = _strategy_file(tmp_path / f"{case.id}-opt.ckpt", [case], {case.id: _mindspore_opt_step(case, tmp_path)})
    return get_parameter_redundancy(str(path), initial_rank=0)[case.id]


def _mindspore_slice(case: Case, full: np.ndarray, rank: int, tmp_path: Path) -> np.ndarray:
    """What MindSpore's `_load_tensor_by_layout` gives rank `rank`: its tensor-parallel slice (`_load_tensor`,
    after `_expand_layout` for a dimension cut over several axes), then its part for optimizer parallel."""
    if not case.shape:
        return full
    if case.nested:
        _, tensor_map, shape = _expand_layout(list(case.dev_matrix), list(case.tensor_map), list(case.shape))
        block = _load_tensor(ms.Tensor(full.reshape(shape)), list(case.dev_matrix), tensor_map, None, rank)
        block = block.reshape(case.tp_slice_shape())
    else:
        block = _load_tensor(ms.Tensor(full), list(case.dev_matrix), list(case.tensor_map), None, rank)
    if case.opt > 1:
        groups = _mindspore_groups(case, tmp_path)
        [index] = [j % case.opt for j, group in enumerate(groups) if rank in group]
        block = np.split(block, case.opt, axis=0)[index]
    return block


def _part(array: Any, region: Region) -> np.ndarray:
    """The region of `array`; the leading Ellipsis keeps a 0-d array an array."""
    return array[(Ellipsis, *region.slices())]


def _distinct(sharded: ShardedTensor) -> list[Region]:
    return sorted(set(sharded.regions), key=lambda region: region.offsets)


@by_id
def test_the_regions_of_all_ranks_tile_the_tensor_exactly(case: Case) -> None:
    sharded = case.layout().sharded(case.shape, case.device_num)
    covered = np.zeros(case.shape, dtype=np.int64)
    for region in _distinct(sharded):
        _part(covered, region)[...] += 1
    assert (covered == 1).all(), covered
    chunks = tuple(Chunk(region, "f", str(i)) for i, region in enumerate(_distinct(sharded)))
    TensorLayout("F32", case.shape, chunks).validate(case.id)  # inside, disjoint, complete
    expected_copies = case.device_num // len(_distinct(sharded))
    assert set(Counter(sharded.regions).values()) == {expected_copies}


@by_id
def test_each_rank_holds_the_slice_mindspore_gives_it(case: Case, tmp_path: Path) -> None:
    layout, full = case.layout(), case.full()
    for rank, region in enumerate(layout.sharded(case.shape, case.device_num).regions):
        mine = _part(full, region)
        theirs = _mindspore_slice(case, full, rank, tmp_path)
        assert mine.shape == theirs.shape and mine.tobytes() == theirs.tobytes(), rank
        if case.shape and not case.nested:
            strategy = _get_tensor_strategy(list(case.dev_matrix), list(case.tensor_map))
            index = _get_tensor_slice_index(list(case.dev_matrix), strategy, list(case.tensor_map), rank)
            assert np.ravel_multi_index(layout.slice_index(rank), layout.splits()) == int(index)


@flat_by_id
def test_ranks_holding_one_region_are_mindspores_groups_and_strategy_files_read_alike(
    case: Case, tmp_path: Path
) -> None:
    path = _strategy_file(tmp_path / "strategy.ckpt", [case], {case.id: _mindspore_opt_step(case, tmp_path)}
                          if case.opt > 1 else None)
    assert read_strategy_file(path) == {case.id: case.layout()}
    ours: dict[Region, list[int]] = {}
    for rank, region in enumerate(case.layout().sharded(case.shape, case.device_num).regions):
        ours.setdefault(region, []).append(rank)
    assert sorted(map(tuple, ours.values())) == sorted(_mindspore_groups(case, tmp_path))


def _opt_group(case: Case, rank: int, tmp_path: Path) -> tuple[int, ...]:
    """Rank's optimizer shard group by MindSpore's rule: consecutive blocks of its replicas."""
    replicas = next(group for group in _mindspore_replicas(case, tmp_path) if rank in group)
    start = replicas.index(rank) // case.opt * case.opt
    return replicas[start : start + case.opt]


def _entry(case: Case, group: str = "", *extra: Any) -> tuple[Any, ...]:
    """A `parameter_layout_dict` entry as GetParameterLayoutFromGraph builds it."""
    tensor_map = [list(axes) if isinstance(axes, list) else axes for axes in case.tensor_map]
    return (list(case.dev_matrix), tensor_map, list(case.tp_slice_shape()), 0, True, group, *extra)


@by_id
def test_parameter_layout_dict_entries_give_the_same_layout(case: Case, tmp_path: Path) -> None:
    group = "4-opt-group" if case.opt > 1 else ""
    sharded = case.layout().sharded(case.shape, case.device_num)
    for rank, region in enumerate(sharded.regions):
        ranks = _opt_group(case, rank, tmp_path) if case.opt > 1 else ()
        assert from_parameter_layout(case.id, _entry(case, group), region.sizes, rank, ranks) == (
            case.layout(), case.shape)
        longer = _entry(case, group, list(case.shape), list(case.tp_slice_shape()), False, False, 0, 0)
        assert from_parameter_layout(case.id, longer, region.sizes, rank, ranks)[0] == case.layout()
        if case.opt > 1:  # in the group, but the data was not cut further: a plain tensor-parallel slice
            layout, _ = from_parameter_layout(case.id, _entry(case, group), case.tp_slice_shape(), rank, ranks)
            assert layout.opt_shard_size == 1


def _save(root: Path, cases: list[Case], world_size: int, extra: dict[str, np.ndarray]) -> Path:
    """Every rank saves its slices of `cases` (and the whole `extra` tensors) through its own writer."""
    sharded = {case.id: case.layout().sharded(case.shape, world_size) for case in cases}
    writers = [CheckpointWriter(root, rank, world_size, commit_timeout_s=30) for rank in range(world_size)]
    try:
        for rank, writer in enumerate(writers):
            local = {case.id: np.array(_part(case.full(), sharded[case.id].regions[rank])) for case in cases}
            writer.save_async(CheckpointMeta(9, 90, 1), local | extra, sharded)
        [step_dir, *_] = [writer.wait() for writer in writers]
        assert step_dir is not None
        return step_dir
    finally:
        for writer in writers:
            writer.close()


@pytest.mark.parametrize("device_num", [2, 4, 8])
def test_a_checkpoint_saved_from_the_ranks_slices_loads_exactly_at_one_two_and_three_ranks(
    device_num: int, tmp_path: Path
) -> None:
    cases = [case for case in CASES if case.device_num == device_num]
    extra: dict[str, np.ndarray] = {"global_step": np.array([41], np.int32), "bias": np.arange(7, dtype=np.float64)}
    step_dir = _save(tmp_path, cases, device_num, extra)

    manifest = read_manifest(step_dir)
    for case in cases:
        tensor = manifest.tensors[case.id]
        assert (tensor.dtype, tensor.shape) == (dtype_name(np.dtype(case.dtype)), case.shape)
        distinct = _distinct(case.layout().sharded(case.shape, device_num))
        assert sorted(c.region.offsets for c in tensor.chunks) == [r.offsets for r in distinct]  # each once
    for world_size in (1, 2, 3):
        for rank in range(world_size):
            loaded, _ = load_checkpoint(step_dir, rank, world_size)
            for case in cases:
                assert loaded[case.id].dtype == np.dtype(case.dtype) and loaded[case.id].shape == case.shape
                assert loaded[case.id].tobytes() == case.full().tobytes(), (case.id, world_size, rank)
            assert all(loaded[name].tobytes() == value.tobytes() for name, value in extra.items())
    for rank in range(device_num):  # a resume at the same layout reads each rank's own slices
        regions = {case.id: case.layout().region(case.shape, rank) for case in cases}
        loaded, _ = load_checkpoint(step_dir, rank, device_num, regions=regions)
        for case in cases:
            assert loaded[case.id].tobytes() == _part(case.full(), regions[case.id]).tobytes()


def test_a_replicated_region_is_written_once_in_pieces_spread_over_the_ranks_holding_it() -> None:
    rows = 2 * MIN_PIECE_BYTES // (4 * 512)  # each column half is 2 MiB of float32
    case = Case("wide", (rows, 1024), (2, 2), (-1, 0))  # column halves, each held by two ranks
    sharded = case.layout().sharded(case.shape, 4)
    pieces = write_assignment({"wide": TensorSpec("F32", case.shape)}, 4, {"wide": sharded})
    assert [len(rank_pieces) for rank_pieces in pieces] == [1, 1, 1, 1]
    for rank, [piece] in enumerate(pieces):
        held = sharded.regions[rank]
        assert piece.region.intersect(held) == piece.region  # a rank writes only from what it holds
    regions = tuple(Chunk(p.region, "f", str(rank)) for rank, [p] in enumerate(pieces))
    TensorLayout("F32", case.shape, regions).validate("wide")

    specs = {"a": TensorSpec("F32", (3000, 700)), "b": TensorSpec("F16", (9,)), "c": TensorSpec("I64", ())}
    whole = {name: ShardedTensor(spec.shape, (Region.full(spec.shape),) * 3) for name, spec in specs.items()}
    assert write_assignment(specs, 3, whole) == write_assignment(specs, 3)  # data parallel, as before


def test_an_optimizer_parallel_native_checkpoint_imports_and_reshards(tmp_path: Path) -> None:
    case = Case("w", (8, 6), (2, 2), (-1, 0), opt=2)
    layout, full = case.layout(), case.full()
    for rank in range(4):
        (tmp_path / "native" / f"rank_{rank}").mkdir(parents=True)
        block = np.ascontiguousarray(full[layout.region(case.shape, rank).slices()])
        save_file({"w": block, "b": np.arange(3, dtype=np.float32)},
                  tmp_path / "native" / f"rank_{rank}" / "net.safetensors")
    item = {"dev_matrix": [2, 2], "tensor_map": [-1, 0], "field": 0,
            "opt_weight_shard_step": _mindspore_opt_step(case, tmp_path), "opt_weight_shard_size": 2}
    (tmp_path / "strategy.json").write_text(json.dumps({"parallel_layout_item": {"w": item}}))

    native = import_native(tmp_path / "native", tmp_path / "strategy.json")
    assert native.tensors["w"].shape == case.shape and len(native.tensors["w"].chunks) == 4
    step_dir = write_resharded(native.directory, native.tensors, CheckpointMeta(0, 0, 0), tmp_path / "out", 3)
    for rank in range(3):
        assert load_checkpoint(step_dir, rank, 3)[0]["w"].tobytes() == full.tobytes()


TP2 = Case("w", (8, 6), (2,), (0, -1))


@pytest.mark.parametrize(
    ("translate", "message"),
    [
        (lambda: from_parameter_layout("w", ([2], [0, -1], [4, 6], 0, False, ""), (4, 6), 0),
         "parameter 'w': uneven splits cannot be represented"),
        (lambda: ParallelLayout((2,), ((0,), ())).region((7, 6), 0),
         "dimension 0 of shape \\[7, 6\\] cannot be cut into 2 equal parts"),
        (lambda: from_parameter_layout("w", ([4], [-1, -1], [6, 2], 0, True, "g"), (2, 2), 0, (0, 1, 2, 3)),
         "parameter 'w': dimension 0 of shape \\[6, 2\\] cannot be cut into 4 equal parts"),
        (lambda: from_parameter_layout("w", ([2], [0, -1], [4, 6], 2, True, ""), (4, 6), 0),
         "parameter 'w': embedding fields \\(field_size 2\\) cannot be represented"),
        (lambda: from_parameter_layout("w", _entry(TP2, "", [8, 6], [2, 12]), (4, 6), 0),
         "parameter 'w': a parameter reshaped to slices of \\[2, 12\\] cannot be represented"),
        (lambda: from_parameter_layout("w", _entry(TP2, "", [8, 6], [4, 6], True, True, 1, 7), (4, 6), 0),
         "parameter 'w': a parameter shared between pipeline stages cannot be represented"),
        (lambda: from_parameter_layout("w", _entry(TP2, "", [16, 6]), (4, 6), 0),
         "parameter 'w': its full shape \\[16, 6\\] is not its slices put together, \\[8, 6\\]"),
        (lambda: TP2.layout().sharded(TP2.shape, 4),
         "covers 2 ranks but the job has 4 \\(pipeline stages cannot be represented\\)"),
        (lambda: from_parameter_layout("w", ([4], [-1, -1], [8, 2], 0, True, "g"), (4, 2), 1, (0, 2)),
         "parameter 'w': its optimizer shard group 'g' holds ranks \\[0, 2\\], but its layout puts rank 1 with "
         "ranks \\[0, 1\\]"),
        (lambda: from_parameter_layout("w", _entry(TP2), (8, 6), 0),
         "parameter 'w': rank 0 holds \\[8, 6\\], but its layout gives slices of \\[4, 6\\]"),
        (lambda: from_parameter_layout("w", ([2], [0, 1], [4, 3], 0, True, ""), (4, 3), 0),
         "parameter 'w': tensor map \\[\\[0\\], \\[1\\]\\] does not fit device matrix \\[2\\]"),
        (lambda: from_parameter_layout("w", ([2, 2], [0, 0], [4, 3], 0, True, ""), (4, 3), 0),
         "does not fit device matrix \\[2, 2\\]"),
        (lambda: ParallelLayout((2, 3), ((), ()), 4),
         "optimizer shard size 4 does not divide the 6 ranks holding each slice"),
        (lambda: from_parameter_layout("w", ([2], [0, -1]), (4, 6), 0),
         "parameter 'w': its layout .* is not a tuple \\(dev_matrix, tensor_map, slice_shape, field_size"),
        (lambda: from_strategy("w", [4], [[-1], [-1]], [], 0, 2, 2),
         "strategy for 'w': opt_weight_shard_step 2 does not match its device matrix"),
    ],
    ids=["not-uniform", "uneven-dimension", "uneven-optimizer-shard", "embedding-field", "reshaped",
         "pipeline-shared", "full-shape-disagrees", "pipeline-stages", "foreign-optimizer-group",
         "local-shape-disagrees", "axis-outside-matrix", "axis-used-twice", "optimizer-shard-size",
         "short-entry", "optimizer-step"],
)
def test_what_cannot_be_represented_is_refused_in_one_line(translate: Any, message: str) -> None:
    with pytest.raises(UnsupportedLayout, match=message) as refused:
        translate()
    assert "\n" not in str(refused.value)


def test_a_writer_refuses_a_slice_that_is_not_the_one_its_layout_gives_it(tmp_path: Path) -> None:
    sharded = {"w": TP2.layout().sharded(TP2.shape, 2)}
    with CheckpointWriter(tmp_path, 1, 2) as writer, pytest.raises(CheckpointError, match="rank 1 holds \\[8, 6\\]"):
        writer.save_async(CheckpointMeta(1, 1, 1), {"w": TP2.full()}, sharded)
