"""Copying a save's tensors into its host buffers on several threads: the part of a save, and of an
in-memory snapshot, that blocks the training step.

One thread's copy does not use a host's memory bandwidth: on the bench machine (2 cores) copying 1 GiB
ran at 13.6 GB/s on one thread and 23.5 GB/s on two (`bench/checkpoint.py` prints both; the VM's second
core is not always free). numpy releases the GIL while it copies an array of a plain dtype, so the threads do copy at
once. The step is blocked anyway while they do, so the cores they take are idle otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

# Beyond a few threads a copy is bound by the memory, not the cores; each rank of a host has its own.
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))
# Small enough that the threads end together, large enough that handing a part over costs nothing.
PART_BYTES = 16 << 20


def _parts(target: np.ndarray, source: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`(target, source)` cut into pairs of about PART_BYTES: flat when both are contiguous, else along
    the first axis (a region of a tensor sharded past its first dimension is not contiguous)."""
    if target.nbytes <= PART_BYTES or target.ndim == 0:
        yield target, source
        return
    if target.flags.c_contiguous and source.flags.c_contiguous:
        flat_target, flat_source = target.reshape(-1), source.reshape(-1)
        step = max(1, PART_BYTES // target.itemsize)
        for start in range(0, flat_target.size, step):
            yield flat_target[start:start + step], flat_source[start:start + step]
        return
    rows = max(1, PART_BYTES // max(1, target[0].nbytes))
    for start in range(0, target.shape[0], rows):
        yield target[start:start + rows], source[start:start + rows]


class ParallelCopier:
    """Copies pairs of arrays of the same shape and dtype, on `threads` threads (1: on the caller's)."""

    def __init__(self, threads: int = COPY_THREADS) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="checkpoint-copy") if threads > 1 else None

    def copy(self, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        """`np.copyto(target, source)` for every `(target, source)`; returns once all are copied, raising
        the first error."""
        parts = [part for target, source in pairs for part in _parts(target, source)]
        if self._pool is None or len(parts) < 2:
            for target, source in parts:
                np.copyto(target, source)
            return
        futures = [self._pool.submit(np.copyto, target, source) for target, source in parts]
        wait(futures)  # all of them, so that no thread writes into a buffer after an error is raised
        for future in futures:
            future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
