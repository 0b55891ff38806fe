"""The read plan: which slice of which stored chunk fills which part of which local tensor. Pure, no I/O.

Because a valid layout covers every tensor exactly once, intersecting the wanted region with every chunk
yields read items that fill the local tensor exactly once, whatever world size wrote the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.layout import Region, TensorLayout


@dataclass(frozen=True)
class ReadItem:
    """Copy `sizes` elements starting at `chunk_offsets` of chunk `key` in `file` to `local_offsets` of `tensor`."""

    tensor: str
    file: str
    key: str
    chunk_offsets: tuple[int, ...]
    local_offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def chunk_slices(self) -> tuple[slice, ...]:
        return Region(self.chunk_offsets, self.sizes).slices()

    def local_slices(self) -> tuple[slice, ...]:
        return Region(self.local_offsets, self.sizes).slices()


def plan_reads(tensors: Mapping[str, TensorLayout], wanted: Mapping[str, Region]) -> tuple[ReadItem, ...]:
    """Read items for the wanted region of each named tensor, grouped by file for sequential reads."""
    items = []
    for name, region in wanted.items():
        layout = tensors.get(name)
        if layout is None:
            raise CheckpointError(f"the checkpoint has no tensor '{name}'")
        if len(region.offsets) != len(layout.shape) or any(
            o < 0 or s < 0 or o + s > d for o, s, d in zip(region.offsets, region.sizes, layout.shape)
        ):
            raise CheckpointError(
                f"tensor '{name}': region (offsets {list(region.offsets)}, sizes {list(region.sizes)}) "
                f"is outside shape {list(layout.shape)}"
            )
        for chunk in layout.chunks:
            common = chunk.region.intersect(region)
            if common is not None:
                items.append(
                    ReadItem(
                        tensor=name,
                        file=chunk.file,
                        key=chunk.key,
                        chunk_offsets=common.relative_to(chunk.region.offsets),
                        local_offsets=common.relative_to(region.offsets),
                        sizes=common.sizes,
                    )
                )
    items.sort(key=lambda item: (item.file, item.key, item.chunk_offsets))
    return tuple(items)
