"""A writing rank's data file, `rank_{r}.safetensors`: the pieces that rank owns, one key per piece."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from trainer.checkpoint.digest import file_digest
from trainer.checkpoint.layout import Chunk, Region
from trainer.checkpoint.manifest import FileEntry
from trainer.checkpoint.safetensors_file import write_safetensors
from trainer.checkpoint.sharding import Piece, TensorSpec


def rank_file_name(rank: int) -> str:
    return f"rank_{rank}.safetensors"


def chunk_key(piece: Piece, shape: tuple[int, ...]) -> str:
    """The tensor's name when the piece is the whole tensor, else the name and the piece's offsets."""
    if piece.region == Region.full(shape):
        return piece.tensor
    return f"{piece.tensor}@{','.join(map(str, piece.region.offsets))}"


def write_rank_file(
    step_dir: Path,
    rank: int,
    pieces: Sequence[Piece],
    specs: Mapping[str, TensorSpec],
    arrays: Iterable[np.ndarray],
) -> tuple[FileEntry, dict[str, list[Chunk]]]:
    """Writes the pieces (data in `arrays`, same order) durably; returns the file entry and the chunks it holds."""
    name = rank_file_name(rank)
    keys = [chunk_key(piece, specs[piece.tensor].shape) for piece in pieces]
    entries = [(key, TensorSpec(specs[p.tensor].dtype, p.region.sizes)) for key, p in zip(keys, pieces)]
    written = write_safetensors(step_dir / name, entries, arrays)
    chunks: dict[str, list[Chunk]] = {}
    for key, piece, (rows, checksums) in zip(keys, pieces, written.segments):
        chunks.setdefault(piece.tensor, []).append(Chunk(piece.region, name, key, rows, checksums))
    digest = file_digest(written.header, ((key, checksums) for key, (_, checksums) in zip(keys, written.segments)))
    return FileEntry(name, written.size, digest), chunks
