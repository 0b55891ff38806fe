"""Admission of Hellos: a connect burst is queued and spread out, not let loose on etcd at once.

A new node costs two fenced etcd writes before its Welcome (its record and a `node_joined` event).
Ten thousand agents connecting at once would put twenty thousand writes in flight on the
coordinator's one event loop, starving the heartbeats of nodes already connected (and the
coordinator's own lease). So at most `concurrent` Hellos are recorded at once; the others wait their
turn, and when the queue is longer than `max_wait_s` would drain, a Hello is deferred at once with a
hint of when to come back (the agent adds jitter), long before its Welcome timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from common.clock import Clock
from daemon.errors import RetryableError

DEFAULT_CONCURRENT_HELLOS = 64
DEFAULT_MAX_WAIT_S = 2.0
MIN_RETRY_AFTER_S = 0.5
_FIRST_GUESS_S = 0.01  # one admission's duration before any was measured
_SMOOTHING = 0.1


class HelloDeferred(RetryableError):
    """Too many Hellos are waiting; come back after `retry_after_s`."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"{retry_after_s:.1f}s of Hellos are queued at this coordinator; retry after that")
        self.retry_after_s = retry_after_s


class HelloAdmission:
    def __init__(self, clock: Clock, concurrent: int = DEFAULT_CONCURRENT_HELLOS,
                 max_wait_s: float = DEFAULT_MAX_WAIT_S) -> None:
        self._clock = clock
        self._concurrent = concurrent
        self._max_wait_s = max_wait_s
        self._slots = asyncio.Semaphore(concurrent)
        self._waiting = 0
        self._admission_s = _FIRST_GUESS_S  # moving average of one admission's duration

    @property
    def waiting(self) -> int:
        return self._waiting

    def expected_wait_s(self) -> float:
        """How long a Hello arriving now would wait for its turn, at the recent pace."""
        return self._waiting * self._admission_s / self._concurrent

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Hold one of the `concurrent` places while the body runs.

        Raises:
            HelloDeferred: the queue would take longer than `max_wait_s` to reach this Hello.
        """
        wait_s = self.expected_wait_s()
        if wait_s > self._max_wait_s:
            raise HelloDeferred(max(MIN_RETRY_AFTER_S, wait_s))
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        started = self._clock.now()
        try:
            yield
        finally:
            self._slots.release()
            took = self._clock.now() - started
            self._admission_s += _SMOOTHING * (took - self._admission_s)
