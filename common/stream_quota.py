"""A fair share for every certificate: at most a few calls open at once per identity.

A server's overall bound (the coordinator's `max_sessions`, the SnapshotPeer's queue) is shared by every
client, so one certificate that opens calls and leaves them idle could hold all of it: streams that never sent
a Hello held the coordinator's sessions until their Hello timed out, and a restarted real agent was refused
RESOURCE_EXHAUSTED for 35 s, went LOST and the job went WAITING; 16 stalled fetches locked the real peers out
of an agent's snapshots. With a quota per identity, one certificate holds at most its share, and another
is never refused because of it. The coordinator counts its streams (Session, Health/Watch) in
daemon/peer_auth.py, an agent every call of its SnapshotPeer in agent/snapshots/peer_service.py.

Thread-safe: the SnapshotPeer serves on a thread pool. It holds an entry only for an identity with a call
open, so it is as large as the calls open, never larger.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager


class QuotaExceeded(Exception):
    """The identity already has as many calls open as it may; the message is one line naming it."""


class StreamQuota:
    """At most `per_identity` calls open at once for each identity."""

    def __init__(self, per_identity: int) -> None:
        if per_identity < 1:
            raise ValueError(f"a quota of {per_identity} calls admits nobody")
        self.per_identity = per_identity
        self._open: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def open_calls(self, identity: Hashable) -> int:
        with self._lock:
            return self._open.get(identity, 0)

    @property
    def identities(self) -> int:
        """How many identities have a call open."""
        with self._lock:
            return len(self._open)

    @contextmanager
    def held(self, identity: Hashable, who: str) -> Iterator[None]:
        """One call of `identity` (named `who` in the refusal) for as long as the block runs; QuotaExceeded,
        before the block, when it already has `per_identity` open."""
        with self._lock:
            count = self._open.get(identity, 0)
            if count >= self.per_identity:
                raise QuotaExceeded(f"{who} already has {count} calls open here, the most one certificate may; "
                                    f"retry when one has ended")
            self._open[identity] = count + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._open[identity] - 1
                if left:
                    self._open[identity] = left
                else:
                    del self._open[identity]
