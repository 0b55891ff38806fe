"""Property tests: for random shapes, random N-way stored layouts and M-way targets, the read plan fills every
local tensor exactly once with exactly the elements numpy slicing of the global tensor gives.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.checkpoint.layout import Chunk, Region, TensorLayout
from trainer.checkpoint.read_plan import plan_reads
from trainer.checkpoint.sharding import MIN_PIECE_BYTES, TensorSpec, local_region, write_assignment

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)


@st.composite
def stored_layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], int, TensorLayout]:
    """A tensor cut by a random grid (any dimension, uneven cuts) into chunks spread over N random files."""
    shape = draw(shapes)
    n_files = draw(st.integers(1, 5))
    cuts = []
    for extent in shape:
        inner = draw(st.sets(st.integers(1, max(extent - 1, 1)), max_size=3)) if extent > 1 else set()
        cuts.append([0, *sorted(inner), extent])
    chunks = []
    for index, cell in enumerate(np.ndindex(*[len(c) - 1 for c in cuts])):
        offsets = tuple(cuts[d][i] for d, i in enumerate(cell))
        sizes = tuple(cuts[d][i + 1] - cuts[d][i] for d, i in enumerate(cell))
        file = f"rank_{draw(st.integers(0, n_files - 1))}.safetensors"
        chunks.append(Chunk(Region(offsets, sizes), file, f"t@{index}"))
    return shape, n_files, TensorLayout("F32", shape, tuple(chunks))


def _execute(layout: TensorLayout, region: Region, source: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Carries out the plan against in-memory chunks: the local tensor, and how often each element was written."""
    stored = {(c.file, c.key): source[(Ellipsis, *c.region.slices())] for c in layout.chunks}
    local = np.full(region.sizes, np.nan, dtype=np.float32)
    writes = np.zeros(region.sizes, dtype=np.int64)
    for item in plan_reads({"t": layout}, {"t": region}):
        assert item.tensor == "t"
        local[(Ellipsis, *item.local_slices())] = stored[(item.file, item.key)][(Ellipsis, *item.chunk_slices())]
        writes[(Ellipsis, *item.local_slices())] += 1
    return local, writes


@settings(max_examples=150, deadline=None)
@given(stored_layouts(), st.integers(1, 5), st.data())
def test_plan_covers_each_local_tensor_exactly_once(
    case: tuple[tuple[int, ...], int, TensorLayout], world_size: int, data: st.DataObject
) -> None:
    shape, _, layout = case
    layout.validate("t")
    source = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    shard_dim = data.draw(st.none() | st.integers(0, len(shape) - 1)) if shape else None
    for rank in range(world_size):
        region = local_region(shape, rank, world_size, shard_dim)
        local, writes = _execute(layout, region, source)
        assert (writes == 1).all()
        expected = np.array_split(source, world_size, axis=shard_dim)[rank] if shard_dim is not None else source
        assert np.array_equal(local, expected)


tensor_shapes = st.one_of(
    st.just(()),
    st.tuples(st.integers(0, 400_000)),
    st.tuples(st.integers(0, 60_000), st.integers(0, 9)),
)


@settings(max_examples=80, deadline=None)
@given(
    st.dictionaries(st.text("abc.", min_size=1, max_size=6), tensor_shapes, max_size=6),
    st.integers(1, 6),
    st.integers(1, 5),
)
def test_a_checkpoint_written_by_n_ranks_loads_exactly_at_m_ranks(
    shapes_by_name: dict[str, tuple[int, ...]], writers: int, readers: int
) -> None:
    # F64 so that the larger tensors pass MIN_PIECE_BYTES and are cut across ranks.
    specs = {name: TensorSpec("F64", shape) for name, shape in shapes_by_name.items()}
    assignment = write_assignment(specs, writers)
    layouts = {
        name: TensorLayout(
            spec.dtype,
            spec.shape,
            tuple(
                Chunk(piece.region, f"rank_{rank}.safetensors", f"{name}@{piece.region.offsets}")
                for rank, pieces in enumerate(assignment)
                for piece in pieces
                if piece.tensor == name
            ),
        )
        for name, spec in specs.items()
    }
    for name, layout in layouts.items():
        layout.validate(name)
        if specs[name].nbytes >= writers * MIN_PIECE_BYTES and specs[name].shape[0] >= writers:
            assert len({c.file for c in layout.chunks}) == writers
    # Every rank writes about the same: the spread is at most one piece.
    loads = [sum(p.region.volume * 8 for p in pieces) for pieces in assignment]
    largest = max((p.region.volume * 8 for pieces in assignment for p in pieces), default=0)
    assert max(loads) - min(loads) <= largest
    # Chunks are disjoint (validated), so read items that add up to the region's volume fill it exactly once.
    for name, layout in layouts.items():
        for rank in range(readers):
            region = local_region(layout.shape, rank, readers, 0 if layout.shape else None)
            items = plan_reads(layouts, {name: region})
            assert sum(math.prod(item.sizes) for item in items) == region.volume
