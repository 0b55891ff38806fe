"""Polling until something holds: the one helper the integration tests and the benches share.

Not shipped in the wheel: the benches import it with the repository root on sys.path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(probe: Callable[[], T], timeout: float, what: str, interval: float = 0.2,
               on_timeout: Callable[[], str] = lambda: "",
               error: Callable[[str], Exception] = AssertionError) -> T:
    """Call `probe()` every `interval` seconds until it returns something true, and return that.

    After `timeout` seconds raises `error` (an AssertionError in tests) saying what it waited for,
    followed by `on_timeout()` (the logs that tell why).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise error(f"timed out after {timeout:.0f} s waiting for {what}\n{on_timeout()}")
        time.sleep(interval)
