"""Whether a TCP address can be listened on, asked before gRPC is.

gRPC's core answers a port it cannot bind with a RuntimeError that says nothing of why, after logging
its own multi-line error (`add_port.cc ... Failed to add port`) to stderr. That log can only be
silenced for the whole process (GRPC_VERBOSITY), which would hide gRPC's other errors too. Binding a
plain socket first, with the options gRPC's listener sets (SO_REUSEADDR, no SO_REUSEPORT: trainerd's
servers turn it off), finds the usual mistakes (the port taken by another trainerd, an address not
on this host) with the system's own reason, and gRPC is not asked. The address can still be taken in
between; gRPC's own error then remains the answer.
"""

from __future__ import annotations

import errno
import socket

from common.config_file import parse_host_port

_REASONS = {
    errno.EADDRINUSE: "the address is in use (another trainerd, or another program, listens on it)",
    errno.EADDRNOTAVAIL: "the address is not one of this host's",
    errno.EACCES: "the port is privileged (below 1024) and this process may not bind it",
}


def why_cannot_listen(address: str) -> str | None:
    """Why a TCP listener cannot be bound at `host:port` (at any of its addresses), in a few words, or None
    when it can, or when the address cannot even be parsed or resolved: gRPC's answer says so then."""
    try:
        host, port = parse_host_port(address)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (ValueError, OSError):
        return None
    reasons = []
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                reasons.append(_REASONS.get(exc.errno or 0, exc.strerror or str(exc)))
    # A name with several addresses (localhost: 127.0.0.1 and ::1) is served when gRPC binds any of them.
    return reasons[0] if infos and len(reasons) == len(infos) else None


def accepts_connections(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something listens at `host:port` now: a connection is accepted. Unlike binding, this is not
    fooled by a listener that has just closed (its port can be held a moment longer by the kernel)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
