"""The kernel's view of a running process (Linux `/proc/PID/stat`), for telling a frozen rank from a waiting one.

In a hang every rank looks alike from its output: the one that froze (stopped, or stuck in the kernel)
and the ones waiting for it in a collective. The kernel state tells them apart: "T"/"t" stopped or
traced, "D" uninterruptible sleep, "S"/"R" waiting or running normally.
"""

from __future__ import annotations

def os_state(pid: int) -> str:
    """The state letter of `pid`, or "" when it cannot be read (gone, or not a Linux /proc)."""
    if pid <= 0:
        return ""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read(512)
    except OSError:
        return ""
    # "pid (comm) S ...": comm may itself contain spaces and parentheses, so split at the last ')'.
    _, _, rest = text.rpartition(b")")
    fields = rest.split()
    return fields[0].decode(errors="replace")[:1] if fields else ""
