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
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from agent.worker_user import WorkerUser

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


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


@dataclass(frozen=True)
class Snapshot:
    step: int
    consumed_samples: int


class MemoryDirError(Exception):
    """The memory directory cannot be used (the message says why): the job runs without snapshots."""


class MemorySnapshotDir:
    """`root`: this agent's directory on tmpfs; `user`: who the workers run as (None: the agent's user)."""

    def __init__(self, root: Path, user: WorkerUser | None = None) -> None:
        self.root = root
        self._user = user
        self._known: dict[Path, Snapshot] = {}  # complete snapshots already read, by step directory
        self._reported: dict[str, Snapshot] = {}  # by job: the snapshot pinned under REPORTED_DIR

    def job_dir(self, job: str) -> Path:
        return self.root / job

    def clear(self) -> None:
        """Remove every snapshot of every job (at start and at exit)."""
        self._known.clear()
        self._reported.clear()
        if not self.root.is_symlink() and self.root.is_dir():
            shutil.rmtree(self.root, ignore_errors=True)

    def drop(self, job: str) -> None:
        """Remove the job's snapshots (it completed)."""
        self._reported.pop(job, None)
        _remove(self.job_dir(job))

    def prepare(self, job: str, resume_step: int | None) -> Path:
        """The job's directory, created, without other jobs' directories and without snapshots newer
        than `resume_step` (None: all removed).

        Raises:
            MemoryDirError: the root or the job's directory cannot be created or is not this agent's.
        """
        self._make_root()
        for child in self.root.iterdir():
            if child.name != job:
                _remove(child)
                self._reported.pop(child.name, None)
        directory = self.job_dir(job)
        try:
            directory.mkdir(mode=0o700, exist_ok=True)
            info = os.lstat(directory)
            if not stat.S_ISDIR(info.st_mode):
                raise MemoryDirError(f"{directory} is not a directory")
            if self._user is not None:
                os.chown(directory, self._user.uid, self._user.gid, follow_symlinks=False)
        except OSError as exc:
            raise MemoryDirError(f"cannot create {directory}: {exc.strerror or exc}") from None
        pins = directory / REPORTED_DIR
        if resume_step is None or pins.is_symlink() or pins.exists() and not pins.is_dir():
            _remove(pins)
        stale = [child for child in directory.iterdir() if child != pins]
        for child in stale + (list(pins.iterdir()) if pins.is_dir() else []):
            match = _STEP_DIR.fullmatch(child.name)
            if match is None or resume_step is None or int(match.group(1)) > resume_step:
                _remove(child)
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
        None."""
        found = self._newest_complete(job)
        reported = self._reported.get(job)
        if found is not None and found != reported and self._pin(job, found):
            self._reported[job] = reported = found
        return reported

    def _pin(self, job: str, snapshot: Snapshot) -> bool:
        """Hard-link the snapshot's files under REPORTED_DIR (the manifest last), keeping only the pin
        of the one reported before besides. False when its files went first (the workers removed it: a
        newer one is complete)."""
        name = step_dir_name(snapshot.step)
        source, pins = self.job_dir(job) / name, self.job_dir(job) / REPORTED_DIR
        partial = pins / (name + ".partial")
        try:
            pins.mkdir(mode=0o755, exist_ok=True)
            if not stat.S_ISDIR(os.lstat(pins).st_mode):
                raise NotADirectoryError(f"{pins} is not a directory")
            if (pins / name / MANIFEST_NAME).is_file():  # pinned before (the relaunch resumed from it)
                return True
            _remove(partial)
            partial.mkdir(mode=0o755)
            if self._user is not None:
                for made in (pins, partial):
                    os.chown(made, self._user.uid, self._user.gid, follow_symlinks=False)
            files = sorted((e for e in os.scandir(source) if e.is_file(follow_symlinks=False)),
                           key=lambda e: e.name == MANIFEST_NAME)
            if not files or files[-1].name != MANIFEST_NAME:
                raise FileNotFoundError(f"{source / MANIFEST_NAME} is gone")
            for entry in files:
                os.link(entry.path, partial / entry.name, follow_symlinks=False)
            partial.rename(pins / name)
        except OSError as exc:
            log.debug("cannot pin the snapshot of step %d: %s", snapshot.step, exc)
            _remove(partial)
            return False
        before = self._reported.get(job)
        keep = {name} | (set() if before is None else {step_dir_name(before.step)})
        for child in pins.iterdir():
            if child.name not in keep:
                _remove(child)
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


def _remove(path: Path) -> None:
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
