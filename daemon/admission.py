"""Admission of Hellos: a connect burst is queued and spread out, not let loose on etcd at once.

Two gates, both answering an overload with `HelloDeferred` (RESOURCE_EXHAUSTED and a retry-after hint,
which the agent honours with jitter) rather than a queue longer than the agent will wait:

`OpeningGate`, once a Hello is read: at most `max_opening` sessions are being opened at once (Hello
read, Welcome not yet written). Past that, a Hello is turned away at once with a ticket: each
deferred agent is given its own later moment, one Welcome-time apart at the rate the coordinator has
been welcoming, so ten thousand agents connecting at once come back spread over the time it takes to
welcome them, not together after the same hint. Without it a burst queues more Hellos than the loop
can answer within the agent's Welcome timeout; the agents give up, redial, and every retry costs
both sides again.

`HelloAdmission`, for Hellos that write to etcd: a new node costs two fenced etcd writes before its
Welcome (its record and a `node_joined` event). Ten thousand agents connecting at once would put twenty
thousand writes in flight on the coordinator's one event loop, starving the heartbeats of nodes already
connected (and the coordinator's own lease). So at most `concurrent` Hellos are recorded at once; the
others wait their turn, and when the queue is longer than `max_wait_s` would drain, a Hello is deferred
at once with a hint of when to come back, long before its Welcome timeout.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from common.clock import Clock
from daemon.errors import RetryableError
from proto.vocabulary import MAX_RETRY_AFTER_S

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


DEFAULT_MAX_OPENING = 256
MAX_TICKETS_COUNTED = 100_000  # tickets ahead remembered to count the agents at the door (a bound)
_FIRST_OPENING_GUESS_S = 0.05  # one opening's duration before any was measured


class OpeningGate:
    """Bounds the sessions being opened; past that, each Hello is deferred with a ticket of its own."""

    def __init__(self, clock: Clock, max_opening: int = DEFAULT_MAX_OPENING) -> None:
        self._clock = clock
        self._max_opening = max_opening
        self._opening = 0
        self._opening_s = _FIRST_OPENING_GUESS_S  # moving average of one opening's duration
        # The times of the tickets handed out whose turn is still to come, in order (the last is the latest
        # handed out: the bound drops the earliest). Those whose turn has come are dropped as they are counted.
        self._tickets_ahead: deque[float] = deque(maxlen=MAX_TICKETS_COUNTED)

    @property
    def opening(self) -> int:
        return self._opening

    def welcome_rate(self) -> float:
        """Welcomes per second when the gate is full (Little's law: places / time in a place)."""
        return self._max_opening / self._opening_s

    def agents_at_the_door(self) -> int:
        """Agents turned away whose turn is still to come: the tickets ahead, counted. (Not the time they
        span times the welcome rate: the rate rises as the loop catches up, and that estimate then
        counted agents that were in already. Sessions being opened are not counted either: the
        coordinator holds them from their Hello.) An agent turned away again holds one ticket only: it
        came back at its first, unless that was over MAX_RETRY_AFTER_S ahead (it was told
        MAX_RETRY_AFTER_S, the most an agent honours)."""
        now = self._clock.now()
        while self._tickets_ahead and self._tickets_ahead[0] <= now:
            self._tickets_ahead.popleft()
        return len(self._tickets_ahead)

    def _ticket(self) -> float:
        """Seconds until this deferred agent's turn: one Welcome-time after the last ticket's, and no
        sooner than the sessions being opened now will take to clear."""
        now, welcome_s = self._clock.now(), 1 / self.welcome_rate()
        latest = self._tickets_ahead[-1] if self._tickets_ahead else -math.inf
        ticket_at = max(latest + welcome_s, now + max(MIN_RETRY_AFTER_S, self._opening_s + welcome_s))
        self._tickets_ahead.append(ticket_at)
        return min(MAX_RETRY_AFTER_S, ticket_at - now)

    @asynccontextmanager
    async def opening_session(self) -> AsyncIterator[None]:
        """Hold one of the `max_opening` places while a session is opened (Hello read, Welcome sent).

        Raises:
            HelloDeferred: every place is taken; the hint is this agent's ticket.
        """
        if self._opening >= self._max_opening:
            raise HelloDeferred(self._ticket())
        self._opening += 1
        started = self._clock.now()
        try:
            yield
        finally:
            self._opening -= 1
            took = self._clock.now() - started
            self._opening_s += _SMOOTHING * (max(took, 1e-4) - self._opening_s)


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
