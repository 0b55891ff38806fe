"""Which nodes are alive, from session events and heartbeats kept in the leader's memory.

A heartbeat is a dictionary write, never an etcd write (docs/concepts/architecture.md: etcd cannot absorb thousands of
keepalives per second); etcd learns about a node only when its state changes. Time comes from an
injected clock so the timeouts are tested without sleeping.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.clock import Clock


@dataclass
class _Seen:
    last_seen: float
    connected: bool
    disconnected_at: float | None = None  # when its session broke (None: connected, or adopted)
    back_by: float | None = None  # its Welcome is unconfirmed: no silence counts before then (`welcomed`)
    at_the_door_until: float | None = None  # its Hello was deferred: not silent before then (`at_the_door`)


class LivenessTracker:
    """A node is overdue when nothing was heard from it for `timeout_s`, or its session broke
    `grace_s` ago and it has not reconnected.

    A broken session does not make a node lost at once: the agent gets `grace_s` to reconnect (it
    may only have lost its TCP connection). A dead agent's session breaks at once, so the grace,
    shorter than the timeout, is what makes a killed agent's loss quick to detect. Nodes a new
    leader adopts from etcd get the full timeout: the coordinator failed over, not they. A session that
    ended before its agent confirmed the Welcome gives the node longer (`disconnected`), and so does a
    Hello the coordinator deferred (`at_the_door`). Time the
    coordinator's own event loop was stalled is excused (`excuse`): a saturated coordinator must not
    declare nodes LOST for messages it had not yet got round to reading.
    """

    def __init__(self, clock: Clock, timeout_s: float, grace_s: float | None = None) -> None:
        self._clock = clock
        self._timeout_s = timeout_s
        self._grace_s = timeout_s if grace_s is None else grace_s
        self._nodes: dict[str, _Seen] = {}

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, timeout_s: float) -> None:
        """The heartbeat pace changed (daemon/heartbeat_pace.py)."""
        self._timeout_s = timeout_s

    @property
    def grace_s(self) -> float:
        return self._grace_s

    @grace_s.setter
    def grace_s(self, grace_s: float) -> None:
        """The heartbeat pace changed: an agent's reconnect backs off up to its interval."""
        self._grace_s = grace_s

    def connected(self, node: str) -> None:
        self._nodes[node] = _Seen(self._clock.now(), True)

    def welcomed(self, node: str, unconfirmed_s: float = 0.0) -> None:
        """Its Welcome was written: heard from now. `unconfirmed_s` > 0: until its agent confirms it
        (`confirmed`), its silence counts only after that long, the wait its Hello named: the agent may not
        have read the Welcome yet (a starved host, a burst), and leaves within its current wait."""
        self.heard_from(node)
        seen = self._nodes[node]
        seen.back_by = self._clock.now() + unconfirmed_s if unconfirmed_s > 0 else None
        seen.at_the_door_until = None

    def confirmed(self, node: str) -> None:
        """Its agent sent something after the Welcome: it has it, and the usual deadlines hold."""
        seen = self._nodes.get(node)
        if seen is not None and seen.connected:
            seen.back_by = None

    def heard_from(self, node: str) -> None:
        seen = self._nodes.get(node)
        if seen is None:
            self._nodes[node] = _Seen(self._clock.now(), True)
        else:
            seen.last_seen = self._clock.now()

    def disconnected(self, node: str, unconfirmed_s: float = 0.0) -> None:
        """The session ended: the node has `grace_s` from now to reconnect.

        `unconfirmed_s` > 0: the session ended before its agent confirmed the Welcome. The node has
        `grace_s` + `unconfirmed_s` from now, fixed now (a faster pace later does not shorten it), and its
        silence is not counted before then: most likely its agent gave up as it was welcomed, and its
        next Hello waits in our own queue (Coordinator.close_session)."""
        seen = self._nodes.get(node)
        if seen is not None:
            now = self._clock.now()
            seen.connected = False
            seen.disconnected_at = now
            seen.back_by = now + self._grace_s + unconfirmed_s if unconfirmed_s > 0 else None

    def at_the_door(self, node: str, for_s: float) -> None:
        """Its agent's Hello was turned away with a turn to come back at: it is not silent for `for_s` from
        now (never less than it already had), whatever its session did meanwhile. An untracked node is
        not overdue anyway."""
        seen = self._nodes.get(node)
        if seen is not None:
            until = self._clock.now() + for_s
            seen.at_the_door_until = max(until, seen.at_the_door_until or until)

    def adopt(self, nodes: list[str]) -> None:
        """A new leader gives nodes it knows from etcd one full window to reconnect to it."""
        now = self._clock.now()
        for node in nodes:
            self._nodes.setdefault(node, _Seen(now, False))

    def excuse(self, stall_s: float) -> None:
        """The coordinator itself stalled for `stall_s` (its event loop ran late): whatever it did not
        hear in that time is its own lag, not the nodes' silence, so every deadline moves by it."""
        if stall_s <= 0:
            return
        now = self._clock.now()
        for seen in self._nodes.values():
            seen.last_seen = min(now, seen.last_seen + stall_s)
            if seen.disconnected_at is not None:
                seen.disconnected_at = min(now, seen.disconnected_at + stall_s)
            if seen.back_by is not None:
                seen.back_by += stall_s
            if seen.at_the_door_until is not None:
                seen.at_the_door_until += stall_s

    def forget(self, node: str) -> None:
        """The node left the cluster's records: it is no longer tracked."""
        self._nodes.pop(node, None)

    def is_connected(self, node: str) -> bool:
        seen = self._nodes.get(node)
        return seen is not None and seen.connected

    def age(self, node: str) -> float | None:
        """Seconds since we last heard from `node`, or None when it is not tracked."""
        seen = self._nodes.get(node)
        return None if seen is None else max(0.0, self._clock.now() - seen.last_seen)

    def overdue(self, read_lag_s: float = 0.0) -> list[str]:
        """Tracked nodes silent for longer than the timeout, or disconnected for longer than the grace.

        `read_lag_s`: how far behind the coordinator is reading its agents' messages now
        (daemon/read_lag.py); both deadlines allow that much more."""
        deadlines = self._deadlines(read_lag_s)
        return sorted(name for name, seen in self._nodes.items() if _overdue(seen, *deadlines))

    def is_overdue(self, node: str, read_lag_s: float = 0.0) -> bool:
        """Whether `node` is overdue now (`overdue` names it): the leader asks again before each LOST it
        writes, as writing those before it may have taken long enough for the node to come back."""
        seen = self._nodes.get(node)
        return seen is not None and _overdue(seen, *self._deadlines(read_lag_s))

    def _deadlines(self, read_lag_s: float) -> tuple[float, float, float]:
        """Now, and the moments before which silence and a broken session make a node overdue."""
        now = self._clock.now() - max(0.0, read_lag_s)
        return now, now - self._timeout_s, now - self._grace_s


def _overdue(seen: _Seen, now: float, silent_since: float, broken_since: float) -> bool:
    if seen.at_the_door_until is not None and now <= seen.at_the_door_until:
        return False  # waiting for the turn it was given
    broken_at = None if seen.connected else seen.disconnected_at
    if seen.back_by is not None:  # an unconfirmed Welcome: no silence counts before the deadline
        if now <= seen.back_by:
            return False
        if broken_at is not None:
            return True
    if broken_at is None:
        return seen.last_seen < silent_since
    return seen.last_seen < silent_since or broken_at < broken_since
