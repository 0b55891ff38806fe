"""Monotonic time, injected: production code asks a `Clock`, tests hand it a `FakeClock`.

Liveness, lease deadlines and recovery timeouts all read time through this one protocol, so
their tests move time forward with `FakeClock.advance` instead of sleeping or patching modules.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds; only differences between two readings mean anything."""


class SystemClock:
    """The real monotonic clock (`time.monotonic`)."""

    def now(self) -> float:
        return time.monotonic()


class FakeClock:
    """A clock that moves only when a test calls `advance`."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back ({seconds} s)")
        self._now += seconds
