"""Time, injected: production code asks a `Clock`, tests hand it a `FakeClock`.

Liveness, lease deadlines, recovery timeouts, the agent's stop grace and progress throttling, and the
checkpoint writer's commit wait all read time through this one protocol, so their tests move time
with `FakeClock.advance` (or let a fake sleep move it) instead of sleeping or patching modules.
Pure standard library: the worker side imports it next to MindSpore, the coordinator without it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds; only differences between two readings mean anything."""

    def wall(self) -> float:
        """Seconds since the epoch, for timestamps other hosts and people read."""

    def sleep(self, seconds: float) -> None:
        """Blocks the calling thread for `seconds`.

        Raises:
            ValueError: `seconds` is negative.
        """

    async def asleep(self, seconds: float) -> None:
        """Suspends the calling task for `seconds` (at once when not positive)."""


class SystemClock:
    """The real clocks: `time.monotonic`, `time.time`, `time.sleep`, `asyncio.sleep`."""

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    async def asleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class FakeClock:
    """A clock that moves only when a test calls `advance` or something sleeps on it.

    A sleep moves the clock by its length and returns at once; `asleep` first yields to the event loop
    once, so tasks already woken (an exit already signalled, a message already queued) run before the
    time is up. The wall clock moves with the monotonic one. Thread-safe, since the
    checkpoint writer sleeps on a background thread.
    """

    def __init__(self, start: float = 0.0, wall_start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall_start - start
        self._lock = threading.Lock()

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self._wall_offset

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back ({seconds} s)")
        with self._lock:
            self._now += seconds

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    async def asleep(self, seconds: float) -> None:
        await asyncio.sleep(0)
        self.advance(max(0.0, seconds))
