"""Loads read the aligned bulk of a checkpoint with O_DIRECT: past the page cache (so a restore neither pays
the cache's copy nor evicts what other work cached), and bit for bit what was saved."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tests.checkpoint.conftest import SaveAll
from trainer.checkpoint import load_checkpoint
from trainer.checkpoint.direct_io import ALIGNMENT, aligned_empty, direct_span

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def _cached_bytes(path: Path) -> int:
    """How much of the file is in the page cache now (mincore over a mapping of it)."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        where = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert where not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            pages = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
            assert _libc.mincore(where, size, pages) == 0, os.strerror(ctypes.get_errno())
            return sum(byte & 1 for byte in pages.raw) * mmap.PAGESIZE
        finally:
            _libc.munmap(where, size)
    finally:
        os.close(fd)


def _evict(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def test_a_cold_resharded_load_leaves_the_page_cache_almost_empty(tmp_path: Path, save_all: SaveAll) -> None:
    rng = np.random.default_rng(7)
    tensors = {
        "fc.weight": rng.standard_normal((1024, 1024)).astype(np.float32),
        "fc.bias": rng.standard_normal(1024).astype(np.float32),
        "head.weight": rng.standard_normal((512, 2048)).astype(np.float32),
    }
    step_dir = save_all(tmp_path, tensors, 2)
    files = sorted(step_dir.glob("rank_*.safetensors"))
    total = sum(path.stat().st_size for path in files)
    _evict(files)
    assert sum(_cached_bytes(path) for path in files) == 0

    whole, _ = load_checkpoint(step_dir, 0, 3)
    shards = [load_checkpoint(step_dir, rank, 3, {"fc.weight": 0, "head.weight": 0})[0] for rank in range(3)]

    for name, array in tensors.items():
        assert whole[name].tobytes() == array.tobytes(), name
    for name in ("fc.weight", "head.weight"):
        assert np.concatenate([shard[name] for shard in shards]).tobytes() == tensors[name].tobytes(), name
    # What goes through the cache: the files' headers and the unaligned ends of ranges, a few pages each.
    cached = sum(_cached_bytes(path) for path in files)
    assert cached <= 16 * ALIGNMENT * len(files), f"{cached} of {total} bytes went through the page cache"


def test_checkpoint_files_start_their_data_on_an_aligned_boundary(tmp_path: Path, save_all: SaveAll) -> None:
    step_dir = save_all(tmp_path, {"odd": np.arange(7, dtype=np.int16)}, 1)
    for path in step_dir.glob("rank_*.safetensors"):
        header_length = int.from_bytes(path.read_bytes()[:8], "little")
        assert (8 + header_length) % ALIGNMENT == 0


@given(
    misalignment=st.integers(0, ALIGNMENT - 1),
    offset=st.integers(0, 1 << 40),
    length=st.integers(0, 1 << 24),
    memory_shift=st.integers(0, ALIGNMENT - 1),
)
def test_only_aligned_whole_blocks_go_direct(misalignment: int, offset: int, length: int, memory_shift: int) -> None:
    address = (offset + misalignment) % ALIGNMENT + memory_shift * ALIGNMENT
    head, body = direct_span(address, offset, length)
    assert 0 <= head and 0 <= body and head + body <= length
    if misalignment:
        assert (head, body) == (length, 0)
    if body:
        assert (offset + head) % ALIGNMENT == 0 and (address + head) % ALIGNMENT == 0 and body % ALIGNMENT == 0
        assert head < ALIGNMENT and length - head - body < ALIGNMENT


def test_buffers_of_a_block_or_more_are_aligned() -> None:
    for nbytes in (0, 1, ALIGNMENT - 1, ALIGNMENT, ALIGNMENT + 3, 5 << 20):
        buffer = aligned_empty(nbytes)
        assert buffer.nbytes == nbytes and (nbytes < ALIGNMENT or buffer.ctypes.data % ALIGNMENT == 0)
