"""Where a job's processes run, and the paths inside it that come from the wire.

A script written for msrun finds its data and writes its checkpoints through relative paths, so its
working directory must be the same for every generation: the Launch's `workdir` when the job names
one (the coordinator resolves it to an absolute path), else `<agent work dir>/jobs/<job name>/`.
The per-generation files (rank table, control and skips files, logs) stay in the generation's own
directory. Every name here arrives over the network, so each is checked before it becomes a path:
a job name is one plain path component, a workdir an absolute normalised path other than `/`, and
the graceful-exit file a relative path that stays inside the workdir.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath

# The coordinator's own rule for job names (daemon/config.py), checked again here.
_JOB_NAME = re.compile(r"[A-Za-z0-9_.-]{1,255}")
# Control characters (and DEL) would let a name forge lines in logs and reports.
_CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")


class UnsafeJobPath(ValueError):
    """A job name or path from a Launch that cannot be used; the message says why in one line."""


def is_plain_job_name(job_name: str) -> bool:
    """Whether a job name from the wire may name a directory: one plain path component."""
    return _JOB_NAME.fullmatch(job_name) is not None and job_name not in (".", "..")


def job_workdir(agent_work_dir: Path, job_name: str, workdir: str) -> Path:
    """The processes' working directory: `workdir` when given, else the job's default.

    Raises:
        UnsafeJobPath: the job name is not one plain path component, or `workdir` is not an
            absolute normalised path, is `/`, or holds control characters.
    """
    if not is_plain_job_name(job_name):
        raise UnsafeJobPath(f"job name {job_name!r:.80} is not a plain directory name (letters, digits, '_', '.', '-')")
    if not workdir:
        return agent_work_dir / "jobs" / job_name
    if _CONTROL_CHARACTER.search(workdir):
        raise UnsafeJobPath(f"workdir {workdir!r:.200} holds control characters")
    path = PurePosixPath(workdir)
    if not path.is_absolute():
        raise UnsafeJobPath(f"workdir {workdir!r:.200} is not an absolute path")
    if ".." in path.parts:
        raise UnsafeJobPath(f"workdir {workdir!r:.200} climbs out with '..'")
    if len(path.parts) == 1:
        raise UnsafeJobPath(f"workdir {workdir!r} is the root directory")
    return Path(os.path.normpath(workdir))


def graceful_exit_path(workdir: Path, name: str) -> Path:
    """The script's graceful-exit file `name` inside `workdir`, with the symlinks that exist resolved.

    Raises:
        UnsafeJobPath: `name` is absolute, holds control characters or `..`, or leads out of `workdir`.
    """
    if _CONTROL_CHARACTER.search(name):
        raise UnsafeJobPath(f"graceful_exit_file {name!r:.200} holds control characters")
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts or not relative.name:
        raise UnsafeJobPath(f"graceful_exit_file {name!r:.200} is not a file path inside the workdir")
    root = workdir.resolve()
    path = (root / relative).resolve()
    if path == root or not path.is_relative_to(root):
        raise UnsafeJobPath(f"graceful_exit_file {name!r:.200} leads out of the workdir {root}")
    return path
