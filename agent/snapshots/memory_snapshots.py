"""The shared memory the agent owns for its workers' in-memory snapshots (issue 15).

One directory per host (agent `memory_dir`, on tmpfs: /dev/shm by default), one subdirectory per job.
The workers write snapshots there in the disk checkpoint's format (trainer/runtime/memory_snapshots.py):
`step_N/` with one file per rank and `manifest.json` written last, so a snapshot counts once its
manifest is there. The agent:
- creates the job's directory at each Launch that asks for snapshots (TRAINERD_MEMORY_EVERY) or resumes
  from one (TRAINERD_RESUME_MEMORY_STEP), and tells the workers where it is (TRAINERD_MEMORY_DIR);
- removes, at that Launch, the snapshots newer than the step the generation resumes from (all of them
  when it starts from scratch): they belong to a future the job abandoned, so every snapshot left is
  one the new generation's timeline passes through;
- names the snapshot to resume from for the workers (TRAINERD_RESUME_FROM = its step directory here);
- reports the newest complete snapshot in its heartbeats (`newest`), pinned first: its files
  hard-linked under `.reported/` (no copy: tmpfs links share the pages), the two last reported kept.
  The workers keep only their newest snapshot, and the coordinator may name one reported a heartbeat
  ago, or the one before when its choice crossed a newer report; without the pins the workers would
  often have removed it by the time the relaunch asks for it;
- removes the job's directory when the coordinator's Stop says the job completed, everything when
  it starts (what a crashed agent left) and when it exits, and another job's directory when it
  launches a job. A FAILED or PAUSED job's snapshots stay until then (`trainerctl resume` may use them).
With `run_as`, the job's directory belongs to the worker user, and the agent, which runs as root,
only removes in it (rmtree does not follow symbolic links).

A generation spanning hosts (`HostScope`, TRAINERD_MEMORY_SCOPE=host for its workers) has no manifest:
each rank writes its file and its report (agent/snapshots/snapshot_reports.py). A step is complete on this host
once every local rank's report of this generation and world size is there; the agent pins the newest such
step under `.reported/` as above and, since those workers prune nothing, removes their step directories
older than it. Peers read the pins (`own_snapshots`, `rank_file`: called from the peer server's thread,
hence the lock), the ring copier keeps peers' pins under `.copies/<node>/step_N/` (`copies_root`), the
heartbeats carry what is held here (`held`), and a relaunch builds its checkpoint under
`.resume/step_N/` from what is here and what it fetches (`assemble`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.snapshots.snapshot_reports import agree, read_report, reports_in
from agent.worker_user import WorkerUser
from proto import trainerd_pb2 as pb
from trainer.checkpoint.commit import RankReport, commit_manifest, merge_reports, report_name
from trainer.checkpoint.errors import CheckpointError, CorruptCheckpoint
from trainer.checkpoint.manifest import Manifest, read_manifest
from trainer.checkpoint.rank_file import rank_file_name
from trainer.checkpoint.verify import verify_checkpoint

log = logging.getLogger(__name__)

# The disk checkpoint's names (trainer/checkpoint/manifest.py; tests/agent/test_memory_snapshots.py
# checks that they agree).
MANIFEST_NAME = "manifest.json"
_STEP_DIR = re.compile(r"step_(\d{8,})")
# A manifest larger than this is not read for its step (a real one is a few hundred bytes per tensor).
MAX_MANIFEST_BYTES = 64 << 20
# Under a job's directory: hard links to the snapshot last reported (not a `step_N` name, so the workers'
# retention, which looks only at those, leaves it alone).
REPORTED_DIR = ".reported"
COPIES_DIR = ".copies"  # <node>/step_N/: ring copies of that node's pinned snapshots (agent/snapshots/peer_copier.py)
RESUME_DIR = ".resume"  # step_N/: the checkpoint a relaunch assembled (`assemble`)
OUTBOX_DIR = ".outbox"  # step_N/: the workers' shares of disk checkpoints the agent saves (checkpoint_persister.py)
PARTIAL = ".partial"    # the suffix of a directory still being filled
MAX_HELD = 4            # steps a heartbeat reports as held here
# A peer's copy never takes the memory file system past this fraction full: the workers' own snapshots
# come first, and a peer that claims gigabytes it should not have cannot fill the host's memory.
COPIES_FILL_AT_MOST = 0.75


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


@dataclass(frozen=True)
class Snapshot:
    step: int
    consumed_samples: int


@dataclass(frozen=True)
class HostScope:
    """A generation spanning hosts: this host runs `local_ranks` of `world_size` in `generation`."""

    local_ranks: tuple[int, ...]
    world_size: int
    generation: int


class MemoryDirError(Exception):
    """The memory directory cannot be used (the message says why): the job runs without snapshots."""


class SnapshotAssemblyError(Exception):
    """A snapshot could not be assembled for a relaunch (one line: which rank, what is missing or wrong)."""


Fetch = Callable[[int, Path], None]  # (rank, directory): writes that rank's data file and report there


class MemorySnapshotDir:
    """`root`: this agent's directory on tmpfs; `user`: who the workers run as (None: the agent's user)."""

    def __init__(self, root: Path, user: WorkerUser | None = None) -> None:
        self.root = root
        self.user = user
        self._known: dict[Path, Snapshot] = {}  # complete snapshots already read, by step directory
        self._reported: dict[str, Snapshot] = {}  # by job: the snapshot pinned under REPORTED_DIR
        self._scopes: dict[str, HostScope] = {}   # by job: its generation spans hosts
        # The peer server reads the pins from its own thread while the agent's loop moves them.
        self._lock = threading.RLock()

    def job_dir(self, job: str) -> Path:
        return self.root / job

    def copies_root(self, job: str) -> Path:
        """Where the ring copier keeps peers' snapshots: `<node>/step_N/` under it."""
        return self.job_dir(job) / COPIES_DIR

    def room_for_copies(self) -> int:
        """Bytes a copy of a peer's snapshot may still take here: what is free short of leaving
        1 - COPIES_FILL_AT_MOST of the memory file system free (0 when it cannot be told)."""
        try:
            fs = os.statvfs(self.root)
        except OSError:
            return 0
        reserve = fs.f_blocks * fs.f_frsize * (1 - COPIES_FILL_AT_MOST)
        return max(0, int(fs.f_bavail * fs.f_frsize - reserve))

    def clear(self) -> None:
        """Remove every snapshot of every job (at start and at exit)."""
        with self._lock:
            self._known.clear()
            self._reported.clear()
            self._scopes.clear()
            if not self.root.is_symlink() and self.root.is_dir():
                shutil.rmtree(self.root, ignore_errors=True)

    def drop(self, job: str) -> None:
        """Remove the job's snapshots (it completed)."""
        with self._lock:
            self._reported.pop(job, None)
            self._scopes.pop(job, None)
            remove_entry(self.job_dir(job))

    def prepare(self, job: str, resume_step: int | None, host: HostScope | None = None) -> Path:
        """The job's directory, created, without other jobs' directories and without snapshots newer
        than `resume_step` (None: all removed), its own, its copies' and those assembled (of which only
        `resume_step`'s stays). `host`: the generation spans hosts (None: it runs on this one).

        Raises:
            MemoryDirError: the root or the job's directory cannot be created or is not this agent's.
        """
        with self._lock:
            return self._prepare(job, resume_step, host)

    def _prepare(self, job: str, resume_step: int | None, host: HostScope | None) -> Path:
        self._make_root()
        if host is None:
            self._scopes.pop(job, None)
        else:
            self._scopes[job] = host
        for child in self.root.iterdir():
            if child.name != job:
                remove_entry(child)
                self._reported.pop(child.name, None)
        directory = self.job_dir(job)
        try:
            directory.mkdir(mode=0o700, exist_ok=True)
            info = os.lstat(directory)
            if not stat.S_ISDIR(info.st_mode):
                raise MemoryDirError(f"{directory} is not a directory")
            if self.user is not None:
                os.chown(directory, self.user.uid, self.user.gid, follow_symlinks=False)
        except OSError as exc:
            raise MemoryDirError(f"cannot create {directory}: {exc.strerror or exc}") from None
        pins, copies, resume = (directory / name for name in (REPORTED_DIR, COPIES_DIR, RESUME_DIR))
        for kept in (pins, copies, resume):
            if resume_step is None or kept.is_symlink() or kept.exists() and not kept.is_dir():
                remove_entry(kept)
        stale = [child for child in directory.iterdir() if child not in (pins, copies, resume)]
        stale += real_children(pins)
        for node in real_children(copies):
            if node.is_symlink() or not node.is_dir():
                remove_entry(node)
            else:
                stale += real_children(node)
        for child in stale:
            match = _STEP_DIR.fullmatch(child.name)
            if match is None or resume_step is None or int(match.group(1)) > resume_step:
                remove_entry(child)
        for child in real_children(resume):
            if resume_step is None or child.name != step_dir_name(resume_step):
                remove_entry(child)
        reported = self._reported.get(job)
        if reported is not None and not (directory / REPORTED_DIR / step_dir_name(reported.step)).is_dir():
            del self._reported[job]
        self._known = {path: snap for path, snap in self._known.items() if path.exists()}
        return directory

    def resume_path(self, job: str, step: int) -> Path:
        """Where the workers read the snapshot of `step`: the pinned copy when it is the one pinned,
        else the workers' own directory of it."""
        pinned = self.job_dir(job) / REPORTED_DIR / step_dir_name(step)
        if (pinned / MANIFEST_NAME).is_file():
            return pinned
        return self.job_dir(job) / step_dir_name(step)

    def newest(self, job: str) -> Snapshot | None:
        """The snapshot of `job` to report: the newest complete one here, once pinned under REPORTED_DIR
        (the one pinned before, while a newer one cannot be: its files went before they were linked), or
        None. In a generation spanning hosts, complete means every local rank's share is here, and the
        workers' step directories older than the one pinned are removed."""
        with self._lock:
            host = self._scopes.get(job)
            found = self._newest_complete(job) if host is None else self._newest_host_complete(job, host)
            reported = self._reported.get(job)
            if found is not None and found != reported and self._pin(job, found, host):
                self._reported[job] = reported = found
            if host is not None and reported is not None:
                self._prune_older(job, reported.step)
            return reported

    def workers_changed(self, job: str) -> tuple[tuple[str, int], ...]:
        """What the workers' writing changes, cheaply read: the modification times of `job`'s directory and of
        its step directories (a worker creates a step directory, then renames its files and report into it).
        Equal readings: no snapshot completed in between, so nothing new to pin (a long ListSnapshots looks
        at this, not at every report, while it waits)."""
        directory = self.job_dir(job)
        try:
            readings = [("", os.stat(directory, follow_symlinks=False).st_mtime_ns)]
            with os.scandir(directory) as entries:
                readings += [(e.name, e.stat(follow_symlinks=False).st_mtime_ns) for e in entries
                             if _STEP_DIR.fullmatch(e.name)]
        except OSError:
            return ()
        return tuple(sorted(readings))

    def own_snapshots(self, job: str) -> list[pb.MemorySnapshot]:
        """The snapshots pinned here of ranks written on this host, newest first (what peers may fetch)."""
        with self._lock:
            return [held for _, held in self._held_in(self.job_dir(job) / REPORTED_DIR)]

    def rank_file(self, job: str, step: int, rank: int, kind: pb.PeerFileKind) -> Path | None:
        """A file of `rank`'s whole share of `step` held here (its data or report), in an own pin or in a
        copy of a peer's, or None when none is held: a relaunch fetches a lost host's ranks from the host
        that copied them."""
        if kind == pb.PEER_FILE_DATA:
            name = rank_file_name(rank)
        elif kind == pb.PEER_FILE_REPORT:
            name = report_name(rank)
        else:
            return None
        if step < 0 or rank < 0:
            return None
        with self._lock:
            for source in self._places_of(job, step):
                path = source / name
                try:
                    if read_report(source, rank, step) is not None and stat.S_ISREG(os.lstat(path).st_mode):
                        return path
                except OSError:
                    continue
            return None

    def held(self, job: str) -> list[pb.MemorySnapshot]:
        """For each step held here (own pins and complete copies), the ranks held, newest first, at most
        MAX_HELD; a step whose reports disagree (world size, generation, data position) is left out."""
        with self._lock:
            directory = self.job_dir(job)
            places = [directory / REPORTED_DIR] + [n for n in real_children(directory / COPIES_DIR) if is_real_dir(n)]
            by_step: dict[int, list[RankReport]] = {}
            for place in places:
                for step_dir in step_dirs(place):
                    by_step.setdefault(int(step_dir.name[5:]), []).extend(
                        reports_in(step_dir, int(step_dir.name[5:])).values())
            found = []
            for step, reports in sorted(by_step.items(), reverse=True):
                if reports and agree(reports):
                    found.append(_snapshot_of(step, reports))
                if len(found) == MAX_HELD:
                    break
            return found

    def assemble(self, job: str, step: int, world_size: int, fetch: Fetch) -> Path:
        """The checkpoint of `step` for a relaunch at `world_size`: `.resume/step_N/`, built from the ranks'
        files held here (hard links) and those `fetch(rank, directory)` writes into `directory`, verified
        against their reports (size and digest) and committed with a manifest of the merged reports and
        rank 0's meta. An existing complete one of that step and world size is reused.

        Raises:
            SnapshotAssemblyError: a rank's files are missing, damaged, or of another save.
        """
        resume = self.job_dir(job) / RESUME_DIR
        name = step_dir_name(step)
        target, partial = resume / name, resume / (name + PARTIAL)
        try:
            manifest = read_manifest(target)
            if (manifest.step, manifest.world_size) == (step, world_size):
                return target
        except (CorruptCheckpoint, OSError):
            pass
        remove_entry(target)
        remove_entry(partial)
        try:
            self.make_dir(resume)
            self.make_dir(partial)
            with self._lock:
                missing = [rank for rank in range(world_size) if not self._link_held(job, step, rank, partial)]
            for rank in missing:
                try:
                    fetch(rank, partial)
                except OSError as exc:
                    raise SnapshotAssemblyError(f"cannot fetch rank {rank} of step {step}: {exc}") from None
            _commit(partial, step, world_size)
            partial.rename(target)
        except OSError as exc:
            remove_entry(partial)
            raise SnapshotAssemblyError(f"cannot assemble step {step} in {resume}: {exc}") from None
        except SnapshotAssemblyError:
            remove_entry(partial)
            raise
        log.info("assembled the in-memory snapshot of step %d (world size %d): %d of its ranks fetched",
                 step, world_size, len(missing))
        return target

    def _link_held(self, job: str, step: int, rank: int, into: Path) -> bool:
        """Hard-link `rank`'s files of `step` from the own pins or a copy into `into`; False when not held."""
        for source in self._places_of(job, step):
            if read_report(source, rank, step) is None:
                continue
            try:
                for file in (rank_file_name(rank), report_name(rank)):
                    os.link(source / file, into / file, follow_symlinks=False)
                return True
            except OSError as exc:
                log.debug("cannot link rank %d of step %d from %s: %s", rank, step, source, exc)
                for file in (rank_file_name(rank), report_name(rank)):
                    (into / file).unlink(missing_ok=True)
        return False

    def _places_of(self, job: str, step: int) -> list[Path]:
        """The step directories of `step` held here: the own pin, then each peer's copy."""
        name = step_dir_name(step)
        directory = self.job_dir(job)
        candidates = [directory / REPORTED_DIR / name]
        candidates += [node / name for node in real_children(directory / COPIES_DIR) if is_real_dir(node)]
        return [place for place in candidates if is_real_dir(place)]

    def _held_in(self, place: Path) -> list[tuple[int, pb.MemorySnapshot]]:
        """The snapshots in the step directories under `place` whose reports agree, newest first."""
        found = []
        for step_dir in sorted(step_dirs(place), key=lambda d: int(d.name[5:]), reverse=True):
            step = int(step_dir.name[5:])
            reports = list(reports_in(step_dir, step).values())
            if reports and agree(reports):
                found.append((step, _snapshot_of(step, reports)))
        return found

    def _newest_host_complete(self, job: str, host: HostScope) -> Snapshot | None:
        """The newest step whose every local rank's report of this generation and world size is here."""
        directory = self.job_dir(job)
        for step_dir in sorted(step_dirs(directory), key=lambda d: int(d.name[5:]), reverse=True):
            step = int(step_dir.name[5:])
            known = self._known.get(step_dir)
            if known is not None and all((step_dir / report_name(r)).exists() for r in host.local_ranks):
                return known
            reports = [read_report(step_dir, rank, step) for rank in host.local_ranks]
            if host.local_ranks and all(r is not None and (r.world_size, r.generation) ==
                                        (host.world_size, host.generation) for r in reports):
                meta = reports[0].meta if reports[0] is not None else None
                assert meta is not None  # read_report takes only reports with their meta
                self._known[step_dir] = snapshot = Snapshot(step, meta.consumed_samples)
                return snapshot
        return None

    def _prune_older(self, job: str, step: int) -> None:
        """Remove the workers' step directories older than `step` (scope host: they prune nothing)."""
        for step_dir in step_dirs(self.job_dir(job)):
            if int(step_dir.name[5:]) < step:
                self._known.pop(step_dir, None)
                remove_entry(step_dir)

    def make_dir(self, path: Path) -> None:
        """A directory of the agent's (the worker user's with `run_as`), refused when it is a link."""
        path.mkdir(mode=0o755, exist_ok=True)
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise NotADirectoryError(f"{path} is not a directory")
        if self.user is not None:
            os.chown(path, self.user.uid, self.user.gid, follow_symlinks=False)

    def _pin(self, job: str, snapshot: Snapshot, host: HostScope | None) -> bool:
        """Hard-link the snapshot's files under REPORTED_DIR (the manifest last; in scope host, the local
        ranks' files, each rank's report after its data), keeping only the pin of the one reported
        before besides. False when its files went first (the workers removed it: a newer one is
        complete)."""
        name = step_dir_name(snapshot.step)
        source, pins = self.job_dir(job) / name, self.job_dir(job) / REPORTED_DIR
        partial = pins / (name + ".partial")
        try:
            pins.mkdir(mode=0o755, exist_ok=True)
            if not stat.S_ISDIR(os.lstat(pins).st_mode):
                raise NotADirectoryError(f"{pins} is not a directory")
            if _pinned(pins / name, host):  # pinned before (the relaunch resumed from it)
                return True
            remove_entry(partial)
            partial.mkdir(mode=0o755)
            if self.user is not None:
                for made in (pins, partial):
                    os.chown(made, self.user.uid, self.user.gid, follow_symlinks=False)
            if host is None:
                files = sorted((e.name for e in os.scandir(source) if e.is_file(follow_symlinks=False)),
                               key=lambda name: name == MANIFEST_NAME)
                if not files or files[-1] != MANIFEST_NAME:
                    raise FileNotFoundError(f"{source / MANIFEST_NAME} is gone")
            else:
                files = [name for rank in host.local_ranks for name in (rank_file_name(rank), report_name(rank))]
            for file in files:
                os.link(source / file, partial / file, follow_symlinks=False)
            partial.rename(pins / name)
        except OSError as exc:
            log.debug("cannot pin the snapshot of step %d: %s", snapshot.step, exc)
            remove_entry(partial)
            return False
        before = self._reported.get(job)
        keep = {name} | (set() if before is None else {step_dir_name(before.step)})
        for child in pins.iterdir():
            if child.name not in keep:
                remove_entry(child)
        return True

    def _newest_complete(self, job: str) -> Snapshot | None:
        directory = self.job_dir(job)
        try:
            names = [entry.name for entry in os.scandir(directory) if _STEP_DIR.fullmatch(entry.name)]
        except OSError:
            return None
        for name in sorted(names, key=lambda n: int(n[5:]), reverse=True):
            step_dir = directory / name
            known = self._known.get(step_dir)
            if known is not None and (step_dir / MANIFEST_NAME).exists():
                return known
            snapshot = _read_manifest(step_dir, int(name[5:]))
            if snapshot is not None:
                self._known[step_dir] = snapshot
                return snapshot
        return None

    def _make_root(self) -> None:
        """The root, created 0711 (the worker user may pass through to the job's directory, not list
        it), and refused unless it is a real directory of this agent's user: /dev/shm is writable by
        every user, one of whom may have put something there first."""
        try:
            self.root.mkdir(mode=0o711, parents=True, exist_ok=True)
            info = os.lstat(self.root)
        except OSError as exc:
            raise MemoryDirError(f"cannot create {self.root}: {exc.strerror or exc}") from None
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise MemoryDirError(f"{self.root} is not a directory of this agent's user (uid {os.geteuid()})")


def _pinned(step_dir: Path, host: HostScope | None) -> bool:
    if host is None:
        return (step_dir / MANIFEST_NAME).is_file()
    return step_dir.is_dir() and all((step_dir / report_name(r)).is_file() for r in host.local_ranks)


def _commit(step_dir: Path, step: int, world_size: int) -> None:
    """Make the ranks' files in `step_dir` a checkpoint: their reports agree and each file is the one its
    report describes (every byte verified), the manifest merges them with rank 0's meta."""
    reports = []
    for rank in range(world_size):
        report = read_report(step_dir, rank, step)
        if report is None or report.world_size != world_size:
            raise SnapshotAssemblyError(f"step {step}: rank {rank}'s files are missing, incomplete or of "
                                        f"another save")
        reports.append(report)
    generations = sorted({r.generation for r in reports})
    if len(generations) != 1:
        raise SnapshotAssemblyError(f"step {step}: the ranks' files are of different generations {generations}")
    meta = reports[0].meta
    assert meta is not None  # read_report takes only reports with their meta
    try:
        files, tensors = merge_reports(reports)
        commit_manifest(step_dir, Manifest(meta, world_size, generations[0], files, tensors))
        verify_checkpoint(step_dir)
    except (CheckpointError, CorruptCheckpoint) as exc:
        raise SnapshotAssemblyError(f"step {step}: {exc}") from None


def _snapshot_of(step: int, reports: Sequence[RankReport]) -> pb.MemorySnapshot:
    meta = reports[0].meta
    return pb.MemorySnapshot(step=step, consumed_samples=meta.consumed_samples if meta else 0,
                             ranks=sorted({r.rank for r in reports}), world_size=reports[0].world_size,
                             generation=reports[0].generation)


def real_children(directory: Path) -> list[Path]:
    """The entries of a real directory (none of a link or of what is not there)."""
    return list(directory.iterdir()) if is_real_dir(directory) else []


def is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def step_dirs(directory: Path) -> list[Path]:
    """The `step_N` directories in `directory` (not those still being filled, not links)."""
    return [child for child in real_children(directory) if _STEP_DIR.fullmatch(child.name) and is_real_dir(child)]


def _read_manifest(step_dir: Path, step: int) -> Snapshot | None:
    """The snapshot when its manifest is there and names this step, else None (still being written).
    The workers own the directory: only a regular file is read (no link followed, no FIFO waited on)."""
    try:
        fd = os.open(step_dir / MANIFEST_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_MANIFEST_BYTES:
                return None
            data = json.loads(f.read(MAX_MANIFEST_BYTES + 1))
        if data.get("step") != step:
            return None
        consumed = data.get("consumed_samples")
        if not isinstance(consumed, int) or consumed < 0:
            return None
        return Snapshot(step, consumed)
    except (OSError, ValueError, AttributeError):
        return None


def remove_entry(path: Path) -> None:
    """Remove a snapshot or a job's directory, the manifest first so a half-removed one never counts."""
    try:
        if path.is_symlink() or path.is_file():
            path.unlink()
            return
        if not path.is_dir():
            return
        (path / MANIFEST_NAME).unlink(missing_ok=True)
        shutil.rmtree(path)
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc)
