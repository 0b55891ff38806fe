"""Free TCP ports on 127.0.0.1 for servers the tests start."""

from __future__ import annotations

import socket

_handed_out: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now and that this test session has not handed out before.

    The OS may offer a just-released port again, so two servers started in one test could
    otherwise be given the same one before either binds it.
    """
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
