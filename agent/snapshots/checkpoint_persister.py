"""Disk checkpoints written by the agent from what the workers left in shared memory (issue 15, item 4;
`checkpoint.saved_by: agent`).

A worker's save then blocks its step only while it writes its share into the outbox (TRAINERD_CHECKPOINT_OUTBOX,
`.outbox/` in the job's directory on tmpfs): its data file and its report, exactly what it would have written
to the checkpoint directory (`CheckpointWriter(commit=False)`), and it returns. This agent, in a thread of its
own, takes every step whose local ranks' shares are all in the outbox and saves it as any rank would:

1. per local rank, every byte of the data file is verified against the rank's report (the segment
   checksums), then the file is copied into the checkpoint directory's step directory as the workers' writer
   writes it (O_DIRECT where the file system takes it, temporary name, fsync, rename; read with O_NOFOLLOW
   and only when a regular file: the workers own the outbox), and the report goes last;
2. the agent of rank 0 waits for every rank's report, merges them and commits the manifest, then applies
   retention: the commit protocol of `trainer.checkpoint.commit`, unchanged, so the checkpoint verifies,
   reshards and exports as one the workers wrote, and an agent of another host is just another rank's writer;
3. it reports the commit (rank 0's agent) or the failure (each agent, for its ranks) to the coordinator,
   then removes the step from the outbox.

The workers wait for their previous share to leave the outbox before they write the next (at most one save
per rank in memory, as the writer's one save in flight), and for their last before they exit, so the job
completes only once its last checkpoint is on disk. A worker that crashed after writing its share loses
nothing: the agent saves what is in the outbox until its generation is stopped.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.snapshots.memory_snapshots import remove_entry, step_dirs
from agent.snapshots.snapshot_reports import read_report
from agent.thread_priority import lower_this_threads_priority
from agent.worker_user import WorkerUser
from common.atomic_write import publish, temporary_name
from common.clock import SystemClock
from proto.progress_datagram import failure_reason
from trainer.checkpoint.chunk_reader import ChunkReader
from trainer.checkpoint.commit import (
    RankReport,
    commit_when_reported,
    failure_name,
    mark_failed,
    prepare_share,
    report_name,
    write_report,
)
from trainer.checkpoint.direct_writer import DirectWriter
from trainer.checkpoint.errors import CheckpointError, CorruptCheckpoint
from trainer.checkpoint.manifest import MANIFEST_NAME, step_dir_name
from trainer.checkpoint.rank_file import rank_file_name
from trainer.checkpoint.retention import prune

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.05
# How long rank 0's agent waits for the other hosts' shares of a save: as long as a worker's writer waits.
COMMIT_TIMEOUT_S = 600.0
_COPY_CHUNK = 8 << 20
# A step directory unchanged this long is settled: its modification time is a safe sign of any later change.
_SETTLED_S = 1.0


@dataclass(frozen=True)
class PersistedSave:
    """A step the agent of rank 0 committed to disk."""

    generation: int
    step: int
    consumed_samples: int
    path: Path


@dataclass(frozen=True)
class UnpersistedSave:
    """A step this agent could not save its share of (the reason in one line)."""

    generation: int
    rank: int
    step: int
    reason: str


@dataclass(frozen=True)
class Outbox:
    """One generation's outbox on this host: `local_ranks` of `world_size` write their shares into `directory`;
    the checkpoints go under `checkpoint_dir`, of which retention keeps `keep`. With `owner` (the workers run
    as that user) what the agent writes there is that user's, as if the workers had written it."""

    directory: Path
    checkpoint_dir: Path
    local_ranks: tuple[int, ...]
    world_size: int
    generation: int
    keep: int
    owner: WorkerUser | None = None


class _Stopped(CheckpointError):
    """The generation was stopped while its save was under way."""


class _UntilStopped(SystemClock):
    """The clock rank 0's agent waits for the other hosts' shares on: the wait ends when the generation stops."""

    def __init__(self, stopping: threading.Event) -> None:
        self._stopping = stopping

    def sleep(self, seconds: float) -> None:
        if self._stopping.wait(seconds):
            raise _Stopped("the generation was stopped before every rank's share of the save was written")


class CheckpointPersister:
    """Saves the outbox's complete steps to disk in a thread, calling `on_saved` or `on_failed` from it."""

    def __init__(self, outbox: Outbox, on_saved: Callable[[PersistedSave], None],
                 on_failed: Callable[[UnpersistedSave], None], *, poll_interval_s: float = POLL_INTERVAL_S,
                 commit_timeout_s: float = COMMIT_TIMEOUT_S) -> None:
        self.outbox = outbox
        self._on_saved = on_saved
        self._on_failed = on_failed
        self._poll_interval_s = poll_interval_s
        self._commit_timeout_s = commit_timeout_s
        self._stopping = threading.Event()
        # Steps waiting for a local share, by directory name: the directory's modification time when their
        # reports were last read (a step directory changes whenever a file is written, renamed or removed).
        self._waiting: dict[str, int] = {}
        self._clock = _UntilStopped(self._stopping)
        self._thread = threading.Thread(target=self._run, name=f"checkpoint-persister-g{outbox.generation}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop now (the generation is over: nothing more of it is saved); a save under way is left
        uncommitted, and reported neither saved nor failed."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        lower_this_threads_priority()
        while not self._stopping.is_set():
            try:
                self.persist_ready()
            except Exception:  # noqa: BLE001 - the thread must outlive one bad save; it is logged
                log.exception("the checkpoint persister of generation %d failed a pass", self.outbox.generation)
            self._stopping.wait(self._poll_interval_s)

    def persist_ready(self) -> int:
        """Save every step whose local shares are all in the outbox, oldest first, and give up every step a
        local rank marked failed; the number saved, failed or given up."""
        done = 0
        waiting: dict[str, int] = {}
        for source in sorted(step_dirs(self.outbox.directory), key=lambda d: int(d.name[5:])):
            if self._stopping.is_set():
                break
            step = int(source.name[5:])
            settled = _settled_mtime(source)
            if settled is not None and self._waiting.get(source.name) == settled:
                waiting[source.name] = settled  # nothing came since its reports were read: not read again
                continue
            failed = [rank for rank in self.outbox.local_ranks
                      if (source / failure_name(rank, self.outbox.generation)).exists()]
            if failed:
                self._give_up(step, failed)
                remove_entry(source)
                done += 1
                continue
            reports = [self._report(source, rank, step) for rank in self.outbox.local_ranks]
            if any(report is None for report in reports):
                if settled is not None:
                    waiting[source.name] = settled
                continue
            self._persist(source, step, [r for r in reports if r is not None])
            remove_entry(source)
            done += 1
        self._waiting = waiting
        return done

    def _give_up(self, step: int, failed: list[int]) -> None:
        """Local ranks could not hand over their shares of `step` (each reported it): the step is not saved.
        The other hosts' agents are told at once, as by a writing rank (commit.mark_failed)."""
        outbox = self.outbox
        log.warning("generation %d: ranks %s could not hand their shares of step %d to the agent: not saved",
                    outbox.generation, failed, step)
        step_dir = outbox.checkpoint_dir / step_dir_name(step)
        try:
            self._make_root()
            if not step_dir.exists():
                step_dir.mkdir(exist_ok=True)
                self._hand_over(step_dir)
        except OSError as exc:
            log.warning("cannot mark step %d failed in %s: %s", step, outbox.checkpoint_dir, exc)
            return
        for rank in outbox.local_ranks:
            if rank != 0:  # rank 0's agent is this one, and gives the step up
                mark_failed(step_dir, rank, outbox.generation)

    def _make_root(self) -> None:
        """The checkpoint directory, made (as the workers' user, with `owner`) when it is not there."""
        root = self.outbox.checkpoint_dir
        if not root.exists():
            root.mkdir(parents=True, exist_ok=True)
            self._hand_over(root)

    def _report(self, source: Path, rank: int, step: int) -> RankReport | None:
        report = read_report(source, rank, step)
        if report is None or (report.world_size, report.generation) != (self.outbox.world_size,
                                                                        self.outbox.generation):
            return None
        return report

    def _persist(self, source: Path, step: int, reports: list[RankReport]) -> None:
        outbox = self.outbox
        commits = 0 in outbox.local_ranks
        step_dir: Path | None = None
        rank = reports[0].rank
        try:
            self._make_root()
            for report in reports:
                rank = report.rank
                step_dir = prepare_share(outbox.checkpoint_dir, step, rank, outbox.generation,
                                         commits=commits and rank == 0)
                _copy_share(source, step_dir, report, self._stopping)
                self._hand_over(step_dir, step_dir / rank_file_name(rank), step_dir / report_name(rank))
                log.info("generation %d: rank %d's share of step %d saved in %s", outbox.generation, rank, step,
                         step_dir)
            if not commits or step_dir is None:
                return
            rank = 0
            meta = next(r.meta for r in reports if r.rank == 0)
            assert meta is not None  # read_report takes only reports with their meta
            commit_when_reported(step_dir, meta, outbox.world_size, outbox.generation, self._commit_timeout_s,
                                 self._poll_interval_s, self._clock)
            self._hand_over(step_dir / MANIFEST_NAME)
            prune(outbox.checkpoint_dir, outbox.keep, step)
        except (OSError, CheckpointError) as exc:
            if self._stopping.is_set():
                log.info("generation %d stopped: its checkpoint of step %d is not saved (%s)", outbox.generation,
                         step, exc)
                return
            log.error("generation %d: could not save rank %d's share of step %d to %s: %s", outbox.generation,
                      rank, step, outbox.checkpoint_dir, exc)
            if step_dir is not None:
                for report in reports:
                    if report.rank != 0:  # rank 0's agent then gives the step up at once, not at its timeout
                        mark_failed(step_dir, report.rank, outbox.generation)
            self._on_failed(UnpersistedSave(outbox.generation, rank, step, failure_reason(exc)))
            return
        log.info("generation %d: checkpoint of step %d committed in %s (saved by the agent)", outbox.generation,
                 step, step_dir)
        self._on_saved(PersistedSave(outbox.generation, step, meta.consumed_samples, step_dir))

    def _hand_over(self, *paths: Path) -> None:
        """What the agent made in the checkpoint directory becomes the workers' user's (with `owner`)."""
        owner = self.outbox.owner
        if owner is not None:
            for path in paths:
                os.chown(path, owner.uid, owner.gid, follow_symlinks=False)


def _settled_mtime(directory: Path) -> int | None:
    """`directory`'s modification time (ns) when it is older than _SETTLED_S, else None (also when it is
    gone): a change after it would set a later one, whereas a change within the file system's clock tick of
    a fresh one might leave it as it was."""
    try:
        mtime = os.stat(directory, follow_symlinks=False).st_mtime_ns
    except OSError:
        return None
    return mtime if time.time_ns() - mtime > _SETTLED_S * 1e9 else None


def _copy_share(source: Path, step_dir: Path, report: RankReport, stopping: threading.Event) -> None:
    """Verify every byte of one rank's data file in the outbox against its report (the segment checksums),
    copy it durably, then write the report: the rank's share, as its writer would have left it."""
    name = rank_file_name(report.rank)  # `read_report` took only a report naming this file
    with ChunkReader(source, report.tensors, {name: report.file}) as reader:
        reader.verify(None)
    target = step_dir / name
    tmp = temporary_name(target)
    _copy_regular_file(source / name, tmp, stopping)
    publish(tmp, target)
    write_report(step_dir, report)


def _copy_regular_file(src: Path, dst: Path, stopping: threading.Event) -> None:
    """Copy `src`, refused unless a regular file (no link followed, no FIFO waited on), to `dst` as the
    workers' writer writes (O_DIRECT where the file system takes it, fsynced); given up, `dst` removed, when
    `stopping` is set."""
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptCheckpoint(f"{src.name} in the outbox is not a regular file")
        with DirectWriter(dst) as out:
            if info.st_size:
                with mmap.mmap(fd, info.st_size, prot=mmap.PROT_READ) as mapped, memoryview(mapped) as data:
                    for offset in range(0, info.st_size, _COPY_CHUNK):
                        if stopping.is_set():
                            raise _Stopped(f"stopped while copying {src.name}")
                        out.write(data[offset:offset + _COPY_CHUNK])
            out.finish()
    except BaseException:
        dst.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
