"""Writes safetensors files durably, hashing the bytes while they are written.

The format is an 8-byte little-endian header length, a JSON header (padded with spaces to 8 bytes) naming
each key's dtype, shape and byte range, then the tensors back to back. Writing it here rather than with
`safetensors.numpy.save_file` lets the data stream from the callers' buffers without a second copy, hashes
it on the way, stores bfloat16 without a numpy bfloat16 type, and keeps the file invisible until it is
complete: it is written under a temporary name, fsynced, then renamed.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from trainer.checkpoint.digest import BLOCK_BYTES, StreamingDigest
from trainer.checkpoint.durable_files import publish, temporary_name
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.layout import dtype_name
from trainer.checkpoint.sharding import TensorSpec

# Blocks handed to the digest thread but not hashed yet; bounds the memory a lagging hash keeps alive.
_HASH_LAG_BLOCKS = 8


def _header(entries: Sequence[tuple[str, TensorSpec]], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, spec in entries:
        if key == "__metadata__" or key in header:
            raise CheckpointError(f"key '{key}' cannot be stored twice in one safetensors file")
        header[key] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_all(fd: int, block: memoryview) -> None:
    while block:
        block = block[os.write(fd, block) :]


def write_safetensors(
    path: Path,
    entries: Sequence[tuple[str, TensorSpec]],
    arrays: Iterable[np.ndarray],
    metadata: dict[str, str] | None = None,
) -> tuple[int, str]:
    """Writes `arrays` (one per entry, in order) under the entries' keys; returns (file size, digest).

    The arrays may be produced lazily, so a large file never has to be in memory at once.
    """
    prefix = _header(entries, metadata)
    size = len(prefix) + sum(spec.nbytes for _, spec in entries)
    tmp = temporary_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        with StreamingDigest() as digest:
            digest.update(memoryview(prefix))
            _write_all(fd, memoryview(prefix))
            for (key, spec), array in zip(entries, arrays, strict=True):
                if dtype_name(array.dtype) != spec.dtype or array.shape != spec.shape:
                    raise CheckpointError(
                        f"key '{key}': got {array.dtype} {list(array.shape)}, expected {spec.dtype} {list(spec.shape)}"
                    )
                data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
                for start in range(0, len(data), BLOCK_BYTES):
                    block = data[start : start + BLOCK_BYTES]
                    digest.update(block)
                    _write_all(fd, block)
                    digest.settle(keep=_HASH_LAG_BLOCKS)
            file_digest = digest.hexdigest()
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    publish(tmp, path)
    return size, file_digest
