"""The agent's end of the progress datagrams: a unix datagram socket that decodes and relays each report.

The format, its encoder and its decoder are `proto.progress_datagram`; this module owns the socket.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from proto.progress_datagram import MalformedProgress, ProgressMessage, decode

log = logging.getLogger(__name__)


class ProgressReceiver(asyncio.DatagramProtocol):
    """Decodes each datagram and hands valid messages to `on_message`; counts and drops the rest."""

    def __init__(self, path: Path, on_message: Callable[[ProgressMessage], None]) -> None:
        self.path = path
        self.received = 0
        self.malformed = 0
        self._on_message = on_message

    def datagram_received(self, data: bytes, addr: Any) -> None:
        try:
            message = decode(data)
        except MalformedProgress as exc:
            self.malformed += 1
            # A flood of garbage must not flood the log: the first one is a warning, the rest are counted.
            level = logging.WARNING if self.malformed == 1 else logging.DEBUG
            log.log(level, "Dropped a malformed progress datagram on %s (%d so far): %s",
                    self.path, self.malformed, exc)
            return
        self.received += 1
        self._on_message(message)

    def error_received(self, exc: Exception) -> None:
        log.warning("Progress socket %s reported an error: %s", self.path, exc)


async def open_progress_receiver(
    path: str | os.PathLike[str], on_message: Callable[[ProgressMessage], None]
) -> asyncio.DatagramTransport:
    """Listen for progress datagrams on the unix socket `path`, calling `on_message` for each valid one.

    A socket file left by a previous agent is removed; one that a live process still listens on,
    or a path that is not a socket, is refused. The socket is made owner-only (0600). Counters are on
    `transport.get_protocol()` (a ProgressReceiver). Closing the transport leaves the file; the
    next open removes it.
    """
    path = Path(path)
    _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(str(path))
        os.chmod(path, 0o600)
        sock.setblocking(False)
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: ProgressReceiver(path, on_message), sock=sock
        )
    except BaseException:
        sock.close()
        raise
    return transport


def _remove_stale_socket(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"progress socket path {path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            path.unlink()  # nobody is bound to it: left behind by an agent that is gone
            return
    raise FileExistsError(f"progress socket {path} is in use by another process")
