"""Asynchronous save: the training step waits only while the tensors are copied to host buffers.

`save_async` copies the pieces this rank owns (see `sharding.write_assignment`; of a sharded tensor, parts of
the region this rank holds) into host buffers, on several threads (`parallel_copy`), that are
reused from one save to the next (same shapes every time, so no page faults after the first save), then a
background thread writes and fsyncs `rank_{r}.safetensors` and the rank's report; on rank 0 it then waits
for every rank's report and commits the manifest (see `commit`), then applies retention. At most one save
is in flight: a new save first waits for the previous one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import EllipsisType

import numpy as np

from common.clock import Clock, SystemClock
from trainer.checkpoint.commit import (
    RankReport,
    commit_when_reported,
    link_share,
    mark_failed,
    prepare_share,
    write_report,
)
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.layout import Region, TensorLayout, dtype_name
from trainer.checkpoint.manifest import CheckpointMeta
from trainer.checkpoint.parallel_copy import COPY_THREADS, ParallelCopier
from trainer.checkpoint.rank_file import write_rank_file
from trainer.checkpoint.retention import prune
from trainer.checkpoint.sharding import Piece, ShardedTensor, TensorSpec, write_assignment

log = logging.getLogger(__name__)


def _view(array: np.ndarray, region: Region, origin: Region) -> np.ndarray:
    """The part `region` (global coordinates) of `array`, which holds the region `origin` of its tensor."""
    local = Region(region.relative_to(origin.offsets), region.sizes)
    # The leading Ellipsis keeps a 0-d array a view (indexing it with `()` would give a scalar).
    index: tuple[EllipsisType | slice, ...] = (Ellipsis, *local.slices())
    return array[index]


class CheckpointWriter:
    """Saves this rank's share of every checkpoint under `root`; rank 0 also commits and prunes.

    `generation` identifies the launch of the job and must be the same on every rank of it (the
    coordinator's generation number); `keep` is how many complete checkpoints retention keeps;
    `commit_timeout_s` is how long rank 0 waits for the other ranks' files, polling every `poll_interval_s`
    on `clock`. With `commit=False` every rank writes its file and its report (with the meta) and stops
    there: no rank waits, commits or prunes (in-memory snapshots of a generation spanning hosts, which
    the agents assemble, agent/snapshots/memory_snapshots.py). `copy_threads` copy into the host buffers.
    """

    def __init__(
        self,
        root: Path | str,
        rank: int,
        world_size: int,
        *,
        generation: int = 0,
        keep: int = 3,
        commit_timeout_s: float = 600.0,
        poll_interval_s: float = 0.05,
        clock: Clock = SystemClock(),  # stateless, so one shared default is safe
        commit: bool = True,
        copy_threads: int = COPY_THREADS,
    ) -> None:
        if not 0 <= rank < world_size:
            raise CheckpointError(f"rank {rank} is outside world size {world_size}")
        if keep < 1:
            raise CheckpointError(f"keep must be at least 1, got {keep}")
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.generation = generation
        self.keep = keep
        self._commit_timeout_s = commit_timeout_s
        self._poll_interval_s = poll_interval_s
        self._clock = clock
        self._commit = commit
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"checkpoint-writer-rank{rank}")
        self._pending: Future[Path] | None = None
        self._staging: dict[Piece, np.ndarray] = {}
        self._copier = ParallelCopier(copy_threads)

    def save_async(
        self,
        meta: CheckpointMeta,
        tensors: Mapping[str, np.ndarray],
        sharded: Mapping[str, ShardedTensor] | None = None,
        *,
        share_into: Path | None = None,
    ) -> Future[None]:
        """Copies this rank's share of `tensors` and returns; writing continues in the background. Raises the
        previous save's error, if it failed. Every rank passes the same names: the full tensors, identical on
        every rank, except those named in `sharded`, for which it passes the region of them it holds
        (`sharded[name].regions[rank]`; every rank passes the same `sharded`).

        With `share_into` (a root on the same file system), this rank's share is also placed there as
        `commit.link_share` does, before any commit. Returns a future that is done once this rank's share is
        written (and placed in `share_into`), before rank 0's commit; its exception says why it is not. A
        share that could not be placed in `share_into` is marked failed there and does not fail the save.
        """
        written: Future[None] = Future()
        self._pending = self._submit(meta, tensors, sharded or {}, written, share_into)
        return written

    def wait(self) -> Path | None:
        """Waits for the save in flight; returns its directory (committed, on rank 0), None when idle."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def save(
        self,
        meta: CheckpointMeta,
        tensors: Mapping[str, np.ndarray],
        sharded: Mapping[str, ShardedTensor] | None = None,
    ) -> Path:
        """A synchronous `save_async`; returns the step directory (committed, on rank 0)."""
        return self._submit(meta, tensors, sharded or {}, Future(), None).result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown()
            self._copier.close()

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _submit(
        self,
        meta: CheckpointMeta,
        tensors: Mapping[str, np.ndarray],
        sharded: Mapping[str, ShardedTensor],
        written: Future[None],
        share_into: Path | None,
    ) -> Future[Path]:
        self.wait()
        meta.check()
        unknown = sorted(set(sharded) - set(tensors))
        if unknown:
            raise CheckpointError(f"sharded tensors missing from the save: {unknown[:5]}")
        specs = {}
        for name, array in tensors.items():
            if not isinstance(array, np.ndarray):
                raise CheckpointError(f"tensor '{name}' is a {type(array).__name__}, not a numpy array")
            specs[name] = TensorSpec(dtype_name(array.dtype), sharded[name].shape if name in sharded else array.shape)
        pieces = write_assignment(specs, self.world_size, sharded)[self.rank]
        held = {name: Region.full(array.shape) for name, array in tensors.items()}
        for name, layout in sharded.items():
            held[name] = layout.regions[self.rank]
            if tensors[name].shape != held[name].sizes:
                raise CheckpointError(
                    f"tensor '{name}': rank {self.rank} holds {list(tensors[name].shape)}, but its layout gives it "
                    f"{list(held[name].sizes)} of {list(layout.shape)}"
                )
        staged = self._stage(tensors, held, pieces)
        step_dir = prepare_share(self.root, meta.step, self.rank, self.generation,
                                 commits=self.rank == 0 and self._commit)
        return self._pool.submit(self._write, step_dir, meta, specs, pieces, staged, written, share_into)

    def _stage(
        self, tensors: Mapping[str, np.ndarray], held: Mapping[str, Region], pieces: tuple[Piece, ...]
    ) -> list[np.ndarray]:
        previous, self._staging = self._staging, {}
        copies = []
        for piece in pieces:
            source = _view(tensors[piece.tensor], piece.region, held[piece.tensor])
            buffer = previous.get(piece)
            if buffer is None or buffer.dtype != source.dtype:
                buffer = np.empty(source.shape, source.dtype)
            self._staging[piece] = buffer
            copies.append((buffer, source))
        self._copier.copy(copies)
        return [buffer for buffer, _ in copies]

    def _write(
        self,
        step_dir: Path,
        meta: CheckpointMeta,
        specs: dict[str, TensorSpec],
        pieces: tuple[Piece, ...],
        staged: list[np.ndarray],
        written: Future[None],
        share_into: Path | None,
    ) -> Path:
        try:
            entry, chunks = write_rank_file(step_dir, self.rank, pieces, specs, staged)
            layouts = {name: TensorLayout(s.dtype, s.shape, tuple(chunks.get(name, ()))) for name, s in specs.items()}
            report = RankReport(self.rank, self.world_size, self.generation, meta.step, entry, layouts, meta)
            write_report(step_dir, report)
            if share_into is not None:
                self._share(step_dir, share_into, report, written)
            if not written.done():
                written.set_result(None)
            if self.rank != 0 or not self._commit:
                return step_dir
            commit_when_reported(step_dir, meta, self.world_size, self.generation, self._commit_timeout_s,
                                 self._poll_interval_s, self._clock)
            prune(self.root, self.keep, meta.step)
            return step_dir
        except (OSError, CheckpointError) as exc:
            if self.rank != 0 or not self._commit:  # rank 0 need not wait for this rank's report until its timeout
                mark_failed(step_dir, self.rank, self.generation)
            error = exc if isinstance(exc, CheckpointError) else CheckpointError(
                f"rank {self.rank} could not save {step_dir}: {exc}")
            if not written.done():
                written.set_exception(error)
            if error is exc:
                raise
            raise error from exc
        except BaseException as exc:  # whoever waits for the share must not wait forever
            if not written.done():
                written.set_exception(exc)
            raise

    def _share(self, step_dir: Path, root: Path, report: RankReport, written: Future[None]) -> None:
        """Place this rank's share under `root` too; when it cannot be, mark it failed there and say why in
        `written` (the save itself goes on)."""
        try:
            link_share(step_dir, root, report)
        except OSError as exc:
            mark_failed(root / step_dir.name, self.rank, self.generation)
            written.set_exception(CheckpointError(f"rank {self.rank} could not place its share of step "
                                                  f"{report.step} in {root}: {exc}"))
