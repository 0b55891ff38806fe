"""Waiting, before MindSpore's `init()`, until the scheduler accepts connections.

The ranks of a warm generation start within milliseconds of the scheduler, so a worker's `init()`
often tries the scheduler's port a few milliseconds before it listens. MindSpore 2.10 then retries
only after 500 ms, and its next attempt on the same client fails too (measured: a refused first
connection cost 1.1 s before the worker registered), while every step of the cluster formation
after that waits for the last worker to register. A plain TCP connection that is opened and closed
at once is harmless to the scheduler, so the worker polls with those every few milliseconds first.
"""

from __future__ import annotations

import logging
import socket
import time

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.005
# Beyond this, init() goes ahead and MindSpore's own retries and timeouts apply, as without the wait.
WAIT_LIMIT_S = 60.0


def wait_for_scheduler(address: str, limit_s: float = WAIT_LIMIT_S, interval_s: float = POLL_INTERVAL_S) -> bool:
    """Wait until `address` ("host:port") accepts a TCP connection, at most `limit_s`; whether it did."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + limit_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=max(interval_s, 1.0)):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                log.warning("the scheduler at %s accepted no connection in %.0f s; joining anyway", address, limit_s)
                return False
            time.sleep(interval_s)
