"""Writes safetensors files durably, checksumming the bytes while they are written.

The format is an 8-byte little-endian header length, a JSON header naming each key's dtype, shape and byte
range, then the tensors back to back. The header is padded with spaces so the data starts on a 4 KiB
boundary: a tensor whose bytes start aligned can be loaded with O_DIRECT (see `direct_io`); the safetensors
format allows the padding (its own writer pads to 8 bytes). Writing it here rather than with
`safetensors.numpy.save_file` streams the data from the callers' buffers, checksums its segments on the way
(see `digest`), stores bfloat16 without a numpy bfloat16 type, and keeps the file invisible until it is
complete: it is written under a temporary name (with O_DIRECT, see `direct_writer`), fsynced, renamed.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.atomic_write import publish, temporary_name
from trainer.checkpoint.digest import checksum, segment_rows
from trainer.checkpoint.direct_io import ALIGNMENT
from trainer.checkpoint.direct_writer import DirectWriter
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.layout import dtype_name, itemsize
from trainer.checkpoint.sharding import TensorSpec
from trainer.checkpoint.task_pool import TaskPool


def _header(entries: Sequence[tuple[str, TensorSpec]], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, spec in entries:
        if key == "__metadata__" or key in header:
            raise CheckpointError(f"key '{key}' cannot be stored twice in one safetensors file")
        header[key] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGNMENT)
    return struct.pack("<Q", len(raw)) + raw


@dataclass(frozen=True)
class WrittenFile:
    """What `write_safetensors` wrote: the file size, its header bytes, and per entry the rows per
    checksum segment and the segments' checksums.
    """

    size: int
    header: bytes
    segments: tuple[tuple[int, tuple[str, ...]], ...]


def write_safetensors(
    path: Path,
    entries: Sequence[tuple[str, TensorSpec]],
    arrays: Iterable[np.ndarray],
    metadata: dict[str, str] | None = None,
) -> WrittenFile:
    """Writes `arrays` (one per entry, in order) under the entries' keys, checksumming each segment on the way.

    The arrays may be produced lazily, so a large file never has to be in memory at once.
    """
    prefix = _header(entries, metadata)
    size = len(prefix) + sum(spec.nbytes for _, spec in entries)
    tmp = temporary_name(path)
    try:
        with DirectWriter(tmp) as out, TaskPool() as pool:
            out.write(memoryview(prefix))
            pending: list[tuple[int, list[Future[str]]]] = []
            for (key, spec), array in zip(entries, arrays, strict=True):
                if dtype_name(array.dtype) != spec.dtype or array.shape != spec.shape:
                    raise CheckpointError(
                        f"key '{key}': got {array.dtype} {list(array.shape)}, expected {spec.dtype} {list(spec.shape)}"
                    )
                rows = segment_rows(spec.shape, itemsize(spec.dtype))
                step = max(1, rows * math.prod(spec.shape[1:]) * itemsize(spec.dtype))
                data = np.ascontiguousarray(array).reshape(-1).view(np.uint8).data
                checksums = []
                for start in range(0, len(data), step):
                    segment = data[start : start + step]
                    checksums.append(pool.submit(checksum, [segment]))
                    out.write(segment)
                pending.append((rows, checksums))
            segments = tuple((rows, tuple(f.result() for f in checksums)) for rows, checksums in pending)
            out.finish()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    publish(tmp, path)
    return WrittenFile(size, prefix, segments)
