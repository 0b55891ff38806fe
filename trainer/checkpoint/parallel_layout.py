"""MindSpore's parallel layouts in the layout model's terms: which region of a parameter each rank holds.

Pure (no MindSpore, no numpy, no I/O): the worker, the offline import and the tests share this one
translation. MindSpore describes how (semi-)auto parallel lays a parameter over the ranks of a stage by

- a device matrix: the ranks arranged in a row-major grid (rank r sits at `numpy.unravel_index(r, dev_matrix)`);
- a tensor map: for every tensor dimension the device-matrix axes it is cut over, counted from the RIGHT of
  the device matrix, the outer axis first, or none (-1). Along a dimension cut over axes (a, b) into
  n_a × n_b slices, rank r holds slice `c_a * n_b + c_b`, c being r's coordinates (`_get_tensor_slice_index`
  in mindspore/parallel/_tensor.py, with `_expand_layout` for a dimension cut over several axes);
- optimizer parallel: the ranks holding the same slice ("replicas", in rank order, as MindSpore's
  `DeviceMatrix::GetDevicesByTensorMap` lists them) form consecutive groups of `opt_shard_size` ranks
  (`OperatorInfo::CreateGroupForOptShard`: with size 2, [0, 8, 16, 24] -> [0, 8], [16, 24]), and the i-th
  rank of a group holds the i-th of `opt_shard_size` equal parts of the slice along dimension 0
  (`_load_tensor_by_layout`: `np.split(slice, group_size)[get_rank(group)]`).

Two sources give layouts. `from_parameter_layout` reads an entry of a compiled network's
`parameter_layout_dict`; MindSpore 2.10 fills it in C++ (`GetParameterLayoutFromGraph`) as the tuple
`(dev_matrix, tensor_map, slice_shape, field_size, uniform_split, opt_shard_group, ...)`, where slice_shape is
the tensor-parallel slice (before optimizer sharding) and later fields, when present, are read by
`mindspore.train.serialization._get_merged_param_data` and `checkpoint_transform._sync_params` as the full shape
before a reshape, the slice shape after it, and pipeline-shared flags. `from_strategy` reads the fields of a
strategy file's `ParallelLayouts` (see `native_import`).

What the layout model cannot represent exactly is refused with UnsupportedLayout, in one line naming the
parameter: uneven splits, embedding fields (field_size), reshaped or pipeline-shared parameters, a device matrix
that does not cover the job (pipeline stages), an optimizer shard group that is not the one the layout implies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from trainer.checkpoint.errors import UnsupportedLayout
from trainer.checkpoint.layout import Region
from trainer.checkpoint.sharding import ShardedTensor

NOT_SPLIT = -1
_ENTRY_FIELDS = "(dev_matrix, tensor_map, slice_shape, field_size, uniform_split, opt_shard_group)"


@dataclass(frozen=True)
class ParallelLayout:
    """How one parameter is laid over the ranks of a stage.

    `tensor_map[d]` lists the device-matrix axes (counted from the right, outer first) tensor dimension d is cut
    over, () when it is not cut; `opt_shard_size` is into how many parts optimizer parallel cuts each slice
    along dimension 0 (1: not at all). Raises UnsupportedLayout when the three do not fit together.
    """

    dev_matrix: tuple[int, ...]
    tensor_map: tuple[tuple[int, ...], ...]
    opt_shard_size: int = 1

    def __post_init__(self) -> None:
        if not self.dev_matrix or any(n < 1 for n in self.dev_matrix):
            raise UnsupportedLayout(f"device matrix {list(self.dev_matrix)} is not valid")
        axes = [a for dim_axes in self.tensor_map for a in dim_axes]
        if any(not 0 <= a < len(self.dev_matrix) for a in axes) or len(set(axes)) != len(axes):
            raise UnsupportedLayout(
                f"tensor map {[list(a) for a in self.tensor_map]} does not fit device matrix {list(self.dev_matrix)}"
            )
        replicas = self.device_num // math.prod(self.splits())
        if self.opt_shard_size < 1 or replicas % self.opt_shard_size:
            raise UnsupportedLayout(
                f"optimizer shard size {self.opt_shard_size} does not divide the {replicas} ranks "
                "holding each slice"
            )
        if self.opt_shard_size > 1 and not self.tensor_map:
            raise UnsupportedLayout("a scalar cannot be sharded by optimizer parallel")

    @property
    def device_num(self) -> int:
        return math.prod(self.dev_matrix)

    def _axis_size(self, axis: int) -> int:
        return self.dev_matrix[len(self.dev_matrix) - 1 - axis]

    def splits(self) -> tuple[int, ...]:
        """Into how many slices tensor parallel cuts each dimension (optimizer parallel not counted)."""
        return tuple(math.prod(self._axis_size(a) for a in axes) for axes in self.tensor_map)

    def _coordinate(self, rank: int) -> tuple[int, ...]:
        coordinate = []
        for size in reversed(self.dev_matrix):
            coordinate.append(rank % size)
            rank //= size
        return tuple(reversed(coordinate))

    def slice_index(self, rank: int) -> tuple[int, ...]:
        """The index of rank `rank`'s tensor-parallel slice along each tensor dimension."""
        coordinate = self._coordinate(rank)
        index = []
        for axes in self.tensor_map:
            position = 0
            for axis in axes:
                position = position * self._axis_size(axis) + coordinate[len(self.dev_matrix) - 1 - axis]
            index.append(position)
        return tuple(index)

    def _replica_axes(self) -> tuple[int, ...]:
        """The device-matrix axes (indexed from the left) no dimension is cut over: replicas differ only there."""
        used = {len(self.dev_matrix) - 1 - a for axes in self.tensor_map for a in axes}
        return tuple(i for i in range(len(self.dev_matrix)) if i not in used)

    def _replica_position(self, rank: int) -> int:
        """Where `rank` stands among its replicas: rank order is the row-major order of those axes."""
        coordinate = self._coordinate(rank)
        position = 0
        for i in self._replica_axes():
            position = position * self.dev_matrix[i] + coordinate[i]
        return position

    def _replica_rank(self, rank: int, position: int) -> int:
        """The replica of `rank` at `position` among them."""
        coordinate = list(self._coordinate(rank))
        for i in reversed(self._replica_axes()):
            position, coordinate[i] = divmod(position, self.dev_matrix[i])
        found = 0
        for c, n in zip(coordinate, self.dev_matrix):
            found = found * n + c
        return found

    def replicas(self, rank: int) -> tuple[int, ...]:
        """The ranks holding the same tensor-parallel slice as `rank`, in rank order (`rank` among them)."""
        count = math.prod(self.dev_matrix[i] for i in self._replica_axes())
        return tuple(self._replica_rank(rank, p) for p in range(count))

    def opt_shard_index(self, rank: int) -> int:
        """Which of the `opt_shard_size` parts of its slice `rank` holds."""
        return self._replica_position(rank) % self.opt_shard_size

    def opt_shard_group(self, rank: int) -> tuple[int, ...]:
        """The ranks among which optimizer parallel cuts `rank`'s slice, in the order of their parts."""
        start = self._replica_position(rank) - self.opt_shard_index(rank)
        return tuple(self._replica_rank(rank, p) for p in range(start, start + self.opt_shard_size))

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the part every rank holds of a tensor of global `shape` (checked by `check_shape`)."""
        sizes = [n // k for n, k in zip(shape, self.splits())]
        if sizes:
            sizes[0] //= self.opt_shard_size
        return tuple(sizes)

    def global_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The global shape of a tensor whose every rank holds a part of `local_shape`."""
        if len(local_shape) != len(self.tensor_map):
            raise UnsupportedLayout(
                f"a tensor of {len(local_shape)} dimensions cannot have a tensor map of {len(self.tensor_map)}"
            )
        shape = [n * k for n, k in zip(local_shape, self.splits())]
        if shape:
            shape[0] *= self.opt_shard_size
        return tuple(shape)

    def check_shape(self, shape: tuple[int, ...]) -> None:
        """Raises UnsupportedLayout unless the layout cuts a tensor of global `shape` into equal parts."""
        if len(shape) != len(self.tensor_map):
            raise UnsupportedLayout(
                f"a tensor of {len(shape)} dimensions cannot have a tensor map of {len(self.tensor_map)}"
            )
        cuts = list(self.splits())
        if cuts:
            cuts[0] *= self.opt_shard_size
        uneven = [d for d, (n, k) in enumerate(zip(shape, cuts)) if n % k]
        if uneven:
            d = uneven[0]
            raise UnsupportedLayout(f"dimension {d} of shape {list(shape)} cannot be cut into {cuts[d]} equal parts")

    def region(self, shape: tuple[int, ...], rank: int) -> Region:
        """The region of a tensor of global `shape` that rank `rank` holds."""
        self.check_shape(shape)
        sizes = self.local_shape(shape)
        offsets = [i * (n // k) for i, n, k in zip(self.slice_index(rank), shape, self.splits())]
        if offsets:
            offsets[0] += self.opt_shard_index(rank) * sizes[0]
        return Region(tuple(offsets), sizes)

    def sharded(self, shape: tuple[int, ...], world_size: int) -> ShardedTensor:
        """The regions every rank of a job of `world_size` ranks holds of a tensor of global `shape`."""
        if self.device_num != world_size:
            raise UnsupportedLayout(
                f"its device matrix {list(self.dev_matrix)} covers {self.device_num} ranks but the job has "
                f"{world_size} (pipeline stages cannot be represented)"
            )
        return ShardedTensor(shape, tuple(self.region(shape, rank) for rank in range(world_size)))


def _tensor_map(value: Any) -> tuple[tuple[int, ...], ...]:
    """MindSpore's tensor map (an int or a list of ints per dimension, -1 for none) as axes per dimension."""
    if not isinstance(value, (list, tuple)):
        raise UnsupportedLayout(f"tensor map {value!r:.80} is not a list")
    axes = []
    for entry in value:
        dim = list(entry) if isinstance(entry, (list, tuple)) else [entry]
        if not all(isinstance(a, int) and not isinstance(a, bool) for a in dim):
            raise UnsupportedLayout(f"tensor map {list(value)!r:.80} holds something other than integers")
        axes.append(tuple(a for a in dim if a != NOT_SPLIT))
    return tuple(axes)


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise UnsupportedLayout(f"{what} {value!r:.80} is not a list of integers")
    return tuple(value)


def from_parameter_layout(
    name: str,
    entry: Sequence[Any],
    local_shape: tuple[int, ...],
    rank: int,
    opt_group_ranks: Sequence[int] = (),
) -> tuple[ParallelLayout, tuple[int, ...]]:
    """The layout and global shape of parameter `name` from its `parameter_layout_dict` entry, given the shape
    it has on rank `rank` and, when the entry names an optimizer shard group, that group's ranks in group order
    (MindSpore's `get_process_group_ranks`). A parameter of such a group whose data was not cut further (the
    local shape is the tensor-parallel slice) is laid out without optimizer sharding. Raises UnsupportedLayout.
    """
    try:
        if not isinstance(entry, (list, tuple)) or len(entry) < 6:
            raise UnsupportedLayout(f"its layout {entry!r:.120} is not a tuple {_ENTRY_FIELDS}")
        dev_matrix, tensor_map, slice_shape = _ints(entry[0], "device matrix"), _tensor_map(entry[1]), entry[2]
        slice_shape = _ints(slice_shape, "slice shape")
        field_size, uniform_split, group = entry[3], entry[4], entry[5]
        if field_size:
            raise UnsupportedLayout(f"embedding fields (field_size {field_size}) cannot be represented")
        if not uniform_split:
            raise UnsupportedLayout("uneven splits cannot be represented")
        layout = ParallelLayout(dev_matrix, tensor_map)
        if len(slice_shape) != len(tensor_map) or len(local_shape) != len(tensor_map):
            raise UnsupportedLayout(
                f"slice shape {list(slice_shape)}, local shape {list(local_shape)} and tensor map "
                f"{[list(a) for a in tensor_map]} disagree on the number of dimensions"
            )
        shape = layout.global_shape(slice_shape)
        _check_extra_fields(entry, shape, slice_shape)
        if group and len(opt_group_ranks) > 1:
            opt_layout = replace(layout, opt_shard_size=len(opt_group_ranks))
            opt_layout.check_shape(shape)
            if opt_layout.opt_shard_group(rank) != tuple(opt_group_ranks):
                raise UnsupportedLayout(
                    f"its optimizer shard group {group!r} holds ranks {list(opt_group_ranks)}, but its layout "
                    f"puts rank {rank} with ranks {list(opt_layout.opt_shard_group(rank))}"
                )
            if tuple(local_shape) == opt_layout.local_shape(shape):
                return opt_layout, shape
        layout.check_shape(shape)
        if tuple(local_shape) != tuple(slice_shape):
            raise UnsupportedLayout(
                f"rank {rank} holds {list(local_shape)}, but its layout gives slices of {list(slice_shape)}"
            )
        return layout, shape
    except UnsupportedLayout as exc:
        raise UnsupportedLayout(f"parameter '{name}': {exc}") from None


def _check_extra_fields(entry: Sequence[Any], shape: tuple[int, ...], slice_shape: tuple[int, ...]) -> None:
    """The fields after the sixth, present in some MindSpore versions: refuse what changes the picture."""
    full_shape = list(entry[6]) if len(entry) > 6 and entry[6] else []
    if full_shape and tuple(full_shape) != shape:
        raise UnsupportedLayout(f"its full shape {full_shape} is not its slices put together, {list(shape)}")
    reshaped = list(entry[7]) if len(entry) > 7 and entry[7] else []
    if reshaped and tuple(reshaped) != slice_shape:
        raise UnsupportedLayout(f"a parameter reshaped to slices of {reshaped} cannot be represented")
    if len(entry) > 8 and entry[8]:
        raise UnsupportedLayout("a parameter shared between pipeline stages cannot be represented")


def from_strategy(
    name: str,
    dev_matrix: Sequence[int],
    tensor_map: Sequence[Sequence[int]],
    split_shape: Sequence[int],
    field: int,
    opt_weight_shard_step: int,
    opt_weight_shard_size: int,
) -> ParallelLayout:
    """The layout of parameter `name` from the fields of a strategy file's `ParallelLayouts`.

    MindSpore records optimizer sharding there only when it saves the shards apart (not aggregated):
    `opt_weight_shard_size` (-1: over all replicas) and `opt_weight_shard_step`, the distance between two
    replicas, checked against the device matrix. Raises UnsupportedLayout.
    """
    try:
        if split_shape:
            raise UnsupportedLayout("uneven splits (param_split_shape) cannot be represented")
        if field:
            raise UnsupportedLayout(f"embedding fields (field {field}) cannot be represented")
        layout = ParallelLayout(tuple(dev_matrix), _tensor_map([list(axes) for axes in tensor_map]))
        if not opt_weight_shard_step or opt_weight_shard_size == 0:
            return layout
        replicas = layout.replicas(0)
        size = len(replicas) if opt_weight_shard_size == NOT_SPLIT else opt_weight_shard_size
        sharded = replace(layout, opt_shard_size=size)
        if size == 1:
            return layout
        step = (replicas[-1] - replicas[0]) // (len(replicas) - 1)  # at least `size` replicas
        if opt_weight_shard_step != step:
            raise UnsupportedLayout(
                f"opt_weight_shard_step {opt_weight_shard_step} does not match its device matrix "
                f"(replicas {list(replicas[:8])} are {step} apart)"
            )
        return sharded
    except UnsupportedLayout as exc:
        raise UnsupportedLayout(f"strategy for '{name}': {exc}") from None
