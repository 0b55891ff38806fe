"""Entering a network namespace from one thread (Python 3.11 has no os.setns): sockets that thread
creates afterwards live in that namespace, whatever thread uses them later."""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def enter_netns(name: str) -> None:
    """Move the calling thread into /run/netns/NAME (made by `ip netns add NAME`)."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)
