"""Replacing a file so that a reader, or the next start after a crash, sees the old file or the whole new one,
never half of one: the data goes to a temporary file beside the target, reaches the disk (fsync), is renamed
over the target, and the rename itself is made durable (fsync of the directory).

Every temporary file is a dot file named after its target and ending in `.tmp` (`.NAME.tmp` for a file
written in pieces, `.NAME.<random>.tmp` for one written whole), so that nothing that lists a directory
mistakes one for data.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Makes renames and unlinks inside `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(final: Path) -> Path:
    """Where a file written in pieces (its writer opens it with flags of its own) waits for `publish`."""
    return final.with_name(f".{final.name}.tmp")


def publish(tmp: Path, final: Path) -> None:
    """Renames an fsynced `tmp` to `final` (replacing it atomically) and makes the rename durable."""
    os.replace(tmp, final)
    fsync_dir(final.parent)


def write_atomically(path: Path, data: bytes, mode: int | None = None) -> None:
    """Replaces `path` with `data` durably: a reader sees the old file or the whole new one, and a failed
    write leaves the old file as it was and no temporary file behind.

    `mode`: the new file's permission bits, whatever the umask (0o600 for a private key); None: what
    open() would give (0o666 less the umask). The temporary file is created anew (O_EXCL, under a random
    name), so neither a leftover file nor a planted link decides where the data goes or who may read it.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666 if mode is None else mode & 0o600)
    try:
        try:
            if mode is not None:
                os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        publish(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
