"""Self-fencing: a host cut off from the coordinator stops its processes by itself.

The coordinator declares a node LOST after `heartbeat.timeout_s` without a heartbeat and carries the
job on without it; the cut-off host's processes must not keep training, or write checkpoint files,
into a world that has moved on. So the agent counts the time since a coordinator last answered it and,
past the same timeout, stops its generation's processes (SIGTERM, SIGKILL after `stop_grace_s`).

What counts as an answer: a Welcome, a HeartbeatAck from the leader, or a refusal from a coordinator
that names the leader (or says none is known yet). The last one keeps a coordinator failover from
fencing: while the standby waits out the dead leader's lease it answers every dial, and the new
leader gives every known node one heartbeat timeout to come back before it declares it LOST.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.clock import Clock


@dataclass(frozen=True)
class FenceTerms:
    """From the Welcome: how long unheard before fencing, and the processes' stop grace."""

    timeout_s: float
    stop_grace_s: float


class ContactWatch:
    """When a coordinator last answered; `overdue` once that is longer ago than the fence timeout.

    Fencing starts only after the first Welcome (no terms, no fence), and at most once per loss of
    contact: `overdue` answers True once, until a coordinator answers again.
    """

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self.terms: FenceTerms | None = None
        self._last_heard = clock.now()
        self._fenced = False

    def welcomed(self, terms: FenceTerms | None) -> None:
        """A session began; `terms` None when the coordinator acknowledges no heartbeats (no fencing)."""
        self.terms = terms
        self.heard()

    def heard(self) -> None:
        self._last_heard = self._clock.now()
        self._fenced = False

    def silent_for(self) -> float:
        return self._clock.now() - self._last_heard

    def silent_too_long(self) -> bool:
        """No answer for longer than the timeout (the session should be given up)."""
        return self.terms is not None and self.silent_for() > self.terms.timeout_s

    def overdue(self) -> bool:
        """True once per loss of contact, when it has lasted longer than the timeout: fence now."""
        if self._fenced or not self.silent_too_long():
            return False
        self._fenced = True
        return True
