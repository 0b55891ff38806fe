"""The one way a checkpoint file is opened for reading: never through a symbolic link, only a regular file.

A checkpoint directory may come from a shared filesystem or from a path sent over the network, so what is in
it is not trusted: a symbolic link could lead a load anywhere (or swap one checkpoint's file for another's),
and a FIFO or a device named `manifest.json` would block a load for ever or feed it endless bytes. The step
directory and every directory on the way to a file are opened with O_NOFOLLOW, each relative to the one
before, and the file itself with O_NOFOLLOW | O_NONBLOCK (opening a FIFO does not wait for a writer), then
refused by `fstat` unless it is a regular file. Directories above the step directory may be links (a
checkpoint root on a mounted volume); whether a path lies inside the root is checked where the path comes in.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from trainer.checkpoint.errors import CorruptCheckpoint

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def open_regular_file(directory: Path, name: str, where: str) -> int:
    """A read-only descriptor of `directory/name`, where `name` is a relative path of plain parts (checked by
    the caller, see `manifest.check_file_name`). The caller closes it.

    Raises CorruptCheckpoint naming `where` (or the directory) when the directory, a directory on the way or
    the file is a symbolic link, or the file is not a regular file; any other OSError (a missing file, no
    permission) is raised as it is, for the caller to phrase.
    """
    *parents, leaf = name.split("/")
    fd = _open_no_follow(None, str(directory), _DIRECTORY_FLAGS, str(directory))
    for depth, part in enumerate(parents, start=1):
        fd = _open_below(fd, part, _DIRECTORY_FLAGS, "/".join([directory.name, *parents[:depth]]))
    fd = _open_below(fd, leaf, _FILE_FLAGS, where)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CorruptCheckpoint(f"{where} is not a regular file but {_kind(mode)}")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_below(parent_fd: int, name: str, flags: int, where: str) -> int:
    """Opens `name` inside the directory open as `parent_fd`, which it closes."""
    try:
        return _open_no_follow(parent_fd, name, flags, where)
    finally:
        os.close(parent_fd)


def _open_no_follow(dir_fd: int | None, path: str, flags: int, where: str) -> int:
    """os.open with O_NOFOLLOW, telling a symbolic link (ELOOP, or ENOTDIR with O_DIRECTORY) from other errors."""
    try:
        return os.open(path, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        try:
            mode = os.lstat(path, dir_fd=dir_fd).st_mode
        except OSError:
            raise exc from None
        if stat.S_ISLNK(mode):
            raise CorruptCheckpoint(
                f"{where} is a symbolic link (checkpoints are read without following links)"
            ) from None
        raise CorruptCheckpoint(f"{where} is not a directory but {_kind(mode)}") from None


def _kind(mode: int) -> str:
    kinds = {stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket", stat.S_ISCHR: "a character device",
             stat.S_ISBLK: "a block device", stat.S_ISDIR: "a directory", stat.S_ISREG: "a regular file"}
    return next((kind for test, kind in kinds.items() if test(mode)), "an unknown kind of file")
