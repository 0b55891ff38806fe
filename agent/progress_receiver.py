"""The agent's end of the progress datagrams: a unix datagram socket that decodes each report and
relays it with the process id of its sender.

The format, its encoder and its decoder are `proto.progress_datagram`; this module owns the socket.
The socket asks the kernel for each sender's credentials (SO_PASSCRED: every datagram comes with an
SCM_CREDENTIALS message the sender cannot forge without CAP_SYS_ADMIN), so the supervisor can take a
report for a rank only from the process it launched for that rank (agent/supervisor.py `on_progress`).
asyncio's datagram transport drops ancillary data, so the socket is read with `recvmsg` when the
loop reports it readable.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import struct
from collections.abc import Callable
from pathlib import Path

from proto.progress_datagram import MAX_DATAGRAM_BYTES, MalformedProgress, ProgressMessage, decode

log = logging.getLogger(__name__)

# struct ucred: pid, uid, gid.
_UCRED = struct.Struct("iII")
# Datagrams read in one go before the loop gets a turn: a flood must not starve the agent.
MAX_DATAGRAMS_PER_READ = 256


class ProgressReceiver:
    """Decodes each datagram and hands valid messages and their sender's pid (0 when the kernel gave
    none) to `on_message`; counts and drops the rest."""

    def __init__(self, sock: socket.socket, path: Path, on_message: Callable[[ProgressMessage, int], None]) -> None:
        self.path = path
        self.received = 0
        self.malformed = 0
        self._sock = sock
        self._on_message = on_message

    def read_waiting(self) -> None:
        """Handle the datagrams waiting on the socket (at most MAX_DATAGRAMS_PER_READ)."""
        for _ in range(MAX_DATAGRAMS_PER_READ):
            try:
                # One byte more than a datagram may have, so an oversized one is seen as such, not cut.
                data, ancillary, _, _ = self._sock.recvmsg(MAX_DATAGRAM_BYTES + 1, socket.CMSG_SPACE(_UCRED.size))
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("Progress socket %s reported an error: %s", self.path, exc)
                return
            self.datagram_received(data, sender_pid(ancillary))

    def datagram_received(self, data: bytes, pid: int) -> None:
        try:
            message = decode(data)
        except MalformedProgress as exc:
            self.malformed += 1
            # A flood of garbage must not flood the log: the first one is a warning, the rest are counted.
            level = logging.WARNING if self.malformed == 1 else logging.DEBUG
            log.log(level, "Dropped a malformed progress datagram from pid %d on %s (%d so far): %s",
                    pid, self.path, self.malformed, exc)
            return
        self.received += 1
        self._on_message(message, pid)

    def close(self) -> None:
        """Stop reading and close the socket; the file stays (the next open removes it)."""
        if self._sock.fileno() >= 0:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()


def sender_pid(ancillary: list[tuple[int, int, bytes]]) -> int:
    """The sender's pid from a datagram's SCM_CREDENTIALS, 0 when there is none."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _UCRED.size:
            pid, _, _ = _UCRED.unpack_from(data)
            return pid
    return 0


async def open_progress_receiver(path: str | os.PathLike[str], on_message: Callable[[ProgressMessage, int], None],
                                 *, group: int | None = None) -> ProgressReceiver:
    """Listen for progress datagrams on the unix socket `path`, calling `on_message(message, sender_pid)`
    for each valid one.

    A socket file left by a previous agent is removed; one that a live process still listens on,
    or a path that is not a socket, is refused. The socket is owner-only (0600), or, with `group`
    (the workers' group when they run as another user), writable by that group too (0660).
    Counters are on the returned ProgressReceiver; `close()` it when done.
    """
    path = Path(path)
    _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.bind(str(path))
        if group is None:
            os.chmod(path, 0o600)
        else:
            os.chown(path, -1, group)
            os.chmod(path, 0o660)
        sock.setblocking(False)
        receiver = ProgressReceiver(sock, path, on_message)
        asyncio.get_running_loop().add_reader(sock.fileno(), receiver.read_waiting)
    except BaseException:
        sock.close()
        raise
    return receiver


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
