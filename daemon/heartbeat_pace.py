"""How often agents heartbeat, and how long the leader waits before a silent node is LOST, for the number
of sessions it holds.

A leader reads every heartbeat and writes every ack on one Python event loop, so what it can absorb is a
rate, not a number of agents: past it, acks come late, agents redial for want of them, and nodes go LOST
that were never silent (bench/heartbeats.py measured exactly that at 10,000 agents on 2 cores). So the
configured interval and timeout hold while `sessions / interval_s` stays within `max_per_s`; beyond, both
stretch together, by steps of sqrt(2), until the rate fits again. A larger cluster is then told of a
silent host later (the timeout grows with the interval), never falsely. The session grace stretches
alike (daemon/coordinator.py): an agent whose session broke backs off up to its interval before it
redials.

Every heartbeat's ack names the pace (proto HeartbeatAck), so agents follow it within one interval. The
leader applies a longer timeout at once, before any agent slows down; after it speeds the pace up again
it keeps the longer timeout for one such timeout more, the time agents need to hear of it.

A connect burst costs the loop more than the heartbeats of the agents held: every Hello read, welcomed or
turned away, and gRPC taking calls the leader cannot count yet. So while agents wait at the door the
leader holds a reserve (`update(..., burst=True)`): the pace RESERVE_STEPS sqrt(2) steps slower than
the count needs. Without it the agents welcomed early in a burst, at the pace of the few held then, went
three of their short intervals without an ack and redialled: most of the broken sessions of a
10,000-agent burst (bench/heartbeats.py; its runs in bench/heartbeats.md). The reserve
is not part of the level that the headroom rule holds on to, so the pace returns to what the count
needs once the burst is over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.clock import Clock

STEP = math.sqrt(2)
# Going back to a faster pace needs this much headroom, so that a cluster near a boundary does not
# switch pace with every agent that comes and goes.
SLOWER_HEADROOM = 1.25
# A burst's reserve: two sqrt(2) steps, the pace for twice the agents counted. It holds until none has
# been at the door for the configured timeout: the door empties and fills again while a burst goes on.
RESERVE_STEPS = 2


@dataclass(frozen=True)
class Pace:
    interval_s: float
    timeout_s: float


class HeartbeatPacer:
    """The pace for `sessions` (`update`), and the timeout the leader applies (`liveness_timeout_s`)."""

    def __init__(self, clock: Clock, interval_s: float, timeout_s: float, max_per_s: float) -> None:
        self._clock = clock
        self._base = Pace(interval_s, timeout_s)
        self._max_per_s = max_per_s
        self._level = 0
        self._reserve = 0  # RESERVE_STEPS while a burst is on: see the module's docstring
        self._burst_seen = -math.inf  # when `update` was last told of a burst
        self._longer_until = -math.inf  # keep `_longer_timeout_s` in force until then
        self._longer_timeout_s = timeout_s

    @property
    def pace(self) -> Pace:
        factor = 2 ** ((self._level + self._reserve) / 2)  # STEP ** steps, exact at whole powers of two
        return Pace(self._base.interval_s * factor, self._base.timeout_s * factor)

    def update(self, sessions: int, burst: bool = False) -> Pace:
        """The pace for holding `sessions`, RESERVE_STEPS slower during a `burst` and for the configured
        timeout after it; moving to a faster pace needs SLOWER_HEADROOM to spare, and the slower one's
        timeout holds while agents hear of it."""
        now = self._clock.now()
        if burst:
            self._burst_seen = now
        before = self.pace
        needed = self._level_for(sessions)
        if needed > self._level:
            self._level = needed
        elif needed < self._level and self._level_for(math.ceil(sessions * SLOWER_HEADROOM)) < self._level:
            self._level = self._level_for(math.ceil(sessions * SLOWER_HEADROOM))
        self._reserve = RESERVE_STEPS if now - self._burst_seen < self._base.timeout_s else 0
        if self.pace.timeout_s < before.timeout_s:
            self._longer_timeout_s = max(before.timeout_s, self._longer_timeout_s if now < self._longer_until else 0.0)
            self._longer_until = now + self._longer_timeout_s
        return self.pace

    def liveness_timeout_s(self) -> float:
        """How long a node may be silent before it is LOST now: the pace's timeout, or a slower pace's
        while agents may not yet have heard that it ended."""
        if self._clock.now() < self._longer_until:
            return max(self.pace.timeout_s, self._longer_timeout_s)
        return self.pace.timeout_s

    def _level_for(self, sessions: int) -> int:
        """The fewest sqrt(2) steps that bring `sessions` heartbeats per interval within the rate."""
        rate = sessions / self._base.interval_s
        if rate <= self._max_per_s:
            return 0
        return math.ceil(round(2 * math.log2(rate / self._max_per_s), 9))
