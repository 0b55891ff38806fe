"""The kernel's view of a running process (Linux `/proc/PID/stat`): its state, for telling a frozen
rank from a waiting one, and its parent, for telling a rank's own processes from others.

In a hang every rank looks alike from its output: the one that froze (stopped, or stuck in the kernel)
and the ones waiting for it in a collective. The kernel state tells them apart: "T"/"t" stopped or
traced, "D" uninterruptible sleep, "S"/"R" waiting or running normally.
"""

from __future__ import annotations

# Parents followed up from a process before it is taken for no descendant of the one looked for.
MAX_ANCESTRY_DEPTH = 32


def _stat_fields(pid: int) -> list[bytes]:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...); [] when unreadable."""
    if pid <= 0:
        return []
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read(512)
    except OSError:
        return []
    # "pid (comm) S ...": comm may itself contain spaces and parentheses, so split at the last ')'.
    _, _, rest = text.rpartition(b")")
    return rest.split()


def os_state(pid: int) -> str:
    """The state letter of `pid`, or "" when it cannot be read (gone, or not a Linux /proc)."""
    fields = _stat_fields(pid)
    return fields[0].decode(errors="replace")[:1] if fields else ""


def parent_pid(pid: int) -> int:
    """The parent of `pid`, or 0 when it cannot be read."""
    fields = _stat_fields(pid)
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else 0


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether `pid` is `ancestor` or one of its descendants (at most MAX_ANCESTRY_DEPTH generations
    down). A process whose parent died was adopted by init and is no longer a descendant."""
    if ancestor <= 1:
        return False
    for _ in range(MAX_ANCESTRY_DEPTH + 1):
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        pid = parent_pid(pid)
    return False
