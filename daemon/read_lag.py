"""How far behind the coordinator reads what its agents send: the allowance its liveness deadlines get.

A saturated coordinator reads heartbeats late. Its event loop need not be late for that (its timers
may run on time): the messages wait in grpc.aio's completion queue, behind thousands of others. A
node whose heartbeat sits there unread is not silent, so the leader adds this lag to the timeout and
the reconnect grace before it declares anything LOST.

The lag is measured on the heartbeats themselves: each carries the agent's `sent_at`. Agents' clocks
differ from ours, so each session's smallest (handled - sent) so far is taken as its clock offset
plus the transit time, and a heartbeat's lag is how much later than that it was handled. The median
over a window is used, so one node on a slow link does not delay the verdict on all the others.
"""

from __future__ import annotations

from typing import Protocol

SAMPLES_PER_WINDOW = 1024  # enough for a median; the rest of a window's heartbeats cost nothing


class HasClockOffset(Protocol):
    clock_offset: float | None


class ReadLag:
    def __init__(self) -> None:
        self._window: list[float] = []
        self._previous = 0.0

    def observe(self, session: HasClockOffset, handled_minus_sent_s: float) -> None:
        """A heartbeat of `session` handled `handled_minus_sent_s` after its `sent_at` (by our clock)."""
        offset = session.clock_offset
        if offset is None or handled_minus_sent_s < offset:
            session.clock_offset = offset = handled_minus_sent_s
        if len(self._window) < SAMPLES_PER_WINDOW:
            self._window.append(handled_minus_sent_s - offset)

    def take(self) -> float:
        """The lag to allow now: the larger median of this window and the one before (so a window
        with few heartbeats does not drop the allowance at once). Starts a new window."""
        window, self._window = self._window, []
        current = sorted(window)[len(window) // 2] if window else 0.0
        allowance, self._previous = max(current, self._previous), current
        return allowance
