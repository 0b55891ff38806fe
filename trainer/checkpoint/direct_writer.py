"""Writing a byte stream with O_DIRECT: bytes are copied into page-aligned blocks that an I/O thread writes
while the next block fills; the last block is padded to the alignment and the file truncated back.

O_DIRECT skips the page cache: a checkpoint neither evicts the cache other work relies on nor costs the
kernel a copy per byte, and the writer does not stall behind the kernel's dirty-page flushing. On the bench
machine it writes 1.3-1.8 GB/s where buffered writes plus fsync give 0.2-1.3 GB/s. Filesystems that refuse
O_DIRECT (tmpfs, some network filesystems) get the same stream through ordinary buffered writes.
"""

from __future__ import annotations

import errno
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from trainer.checkpoint.direct_io import ALIGNMENT, aligned_empty

BLOCK_BYTES = 16 << 20
_BLOCKS = 3


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


class DirectWriter:
    """Writes a new file from a stream of bytes; `finish` makes it durable (fsync). Use as a context manager."""

    def __init__(self, path: Path) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            self._fd = os.open(path, flags | os.O_DIRECT, 0o644)
            self._direct = True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._fd = os.open(path, flags, 0o644)
            self._direct = False
        self._blocks = [aligned_empty(BLOCK_BYTES).data for _ in range(_BLOCKS)]
        self._writes: list[Future[None] | None] = [None] * _BLOCKS
        self._io = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-io")
        self._slot = 0
        self._fill = 0
        self._size = 0

    def write(self, data: memoryview) -> None:
        self._size += len(data)
        while data:
            count = min(len(data), BLOCK_BYTES - self._fill)
            self._blocks[self._slot][self._fill : self._fill + count] = data[:count]
            self._fill += count
            data = data[count:]
            if self._fill == BLOCK_BYTES:
                self._submit(BLOCK_BYTES)

    def _submit(self, length: int) -> None:
        self._writes[self._slot] = self._io.submit(_write_all, self._fd, self._blocks[self._slot][:length])
        self._slot = (self._slot + 1) % _BLOCKS
        self._fill = 0
        waiting = self._writes[self._slot]
        if waiting is not None:
            waiting.result()

    def finish(self) -> None:
        """Writes what is left, waits for every write, trims the padding and fsyncs."""
        if self._fill:
            length = self._fill
            if self._direct:
                length += -length % ALIGNMENT
                self._blocks[self._slot][self._fill : length] = bytes(length - self._fill)
            self._submit(length)
        for pending in self._writes:
            if pending is not None:
                pending.result()
        os.ftruncate(self._fd, self._size)
        os.fsync(self._fd)

    def __enter__(self) -> DirectWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._io.shutdown(cancel_futures=True)
        os.close(self._fd)
