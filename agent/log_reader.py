"""Reading part of a process's log for `trainerctl logs` (the coordinator relays a ReadLog).

The file is named by numbers only (generation, role, rank): `log_path` builds it under the agent's
generations directory, so nothing from the wire becomes a path. It is opened without following a
symlink and must be a regular file.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from agent.generation_dirs import generation_dir

MAX_LOG_READ_BYTES = 1 << 20
ROLES = ("scheduler", "worker")


@dataclass(frozen=True)
class LogRange:
    data: bytes
    offset: int  # where `data` starts in the file
    size: int  # the file's size when it was read


def log_name(role: str, rank: int) -> str:
    return "scheduler" if role == "scheduler" else f"rank{rank}"


def log_path(agent_work_dir: Path, generation: int, role: str, rank: int) -> Path | None:
    """The log of (generation, role, rank); None when no process could have had that name."""
    if generation < 1 or role not in ROLES or (role == "worker" and rank < 0):
        return None
    return generation_dir(agent_work_dir, generation) / f"{log_name(role, rank)}.log"


def describe_process(generation: int, role: str, rank: int) -> str:
    """`worker 7 of generation 2`, `the scheduler of generation 2`, for one-line errors."""
    if role not in ROLES:
        return f"a process of role {role!r:.40} in generation {generation}"
    who = "the scheduler" if role == "scheduler" else f"worker {rank}"
    return f"{who} of generation {generation}"


def read_log_range(path: Path, offset: int, max_bytes: int) -> LogRange:
    """At most `max_bytes` (capped at MAX_LOG_READ_BYTES) from `offset`, or from `-offset` bytes
    before the end when it is negative; an offset past the end reads nothing at the end.

    Raises:
        FileNotFoundError: there is no such log.
        OSError: it cannot be opened or read, or it is not a regular file.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as log_file:
        info = os.fstat(log_file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path.name} is not a regular file")
        size = info.st_size
        start = max(0, size + offset) if offset < 0 else min(offset, size)
        log_file.seek(start)
        data = log_file.read(max(0, min(max_bytes, MAX_LOG_READ_BYTES, size - start)))
    return LogRange(data, start, size)
