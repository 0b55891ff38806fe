"""Keeps etcd leases alive from a thread of its own, over gRPC channels of its own.

Why not the event loop: a coordinator holding ten thousand agents handles tens of thousands of gRPC
completions a second on its event loop, and they all come through grpc.aio's one completion queue. A
keepalive reply waits there behind the heartbeats, and the leader once lost its lease while its
loop's timers ran only 0.4 s late. This thread uses synchronous channels, whose completions it waits
for itself; all it needs is the GIL, which Python hands to a waiting thread within a few milliseconds.
So the lease lives as long as the process runs and etcd answers, however busy the loop is.

A lease is refreshed every TTL/3. It is declared lost when etcd answers TTL <= 0, or when no refresh
has been acknowledged for a whole TTL counted from the moment the last acknowledged request was sent
(no later than etcd's own expiry of it); `on_lost` is then called from this thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from aetcd import rpc

log = logging.getLogger(__name__)

# The member cannot serve us now: move to the next endpoint.
_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_RETRY_S = 0.1  # after a failed refresh, the next attempt (well within TTL/3 of a short lease)


@dataclass
class _Kept:
    lease_id: int
    ttl_s: int
    expires_at: float  # monotonic: a TTL after the newest acknowledged request was sent
    next_send: float
    on_lost: Callable[[str], None]


class LeaseKeeper:
    """Refreshes the leases given to `keep` until they are dropped, lost, or the keeper is closed."""

    def __init__(self, targets: list[str], credentials: grpc.ChannelCredentials | None,
                 options: list[tuple[str, int]], timeout_s: float, token: Callable[[], tuple[tuple[str, str], ...]],
                 login: tuple[str, str] | None = None) -> None:
        """`token`: the store's current auth metadata; `login` (name, password) to get a fresh token
        when etcd says ours expired."""
        if credentials is None:
            self._channels = [grpc.insecure_channel(t, options=options) for t in targets]
        else:
            self._channels = [grpc.secure_channel(t, credentials, options=options) for t in targets]
        self._targets = targets
        self._current = 0
        self._timeout_s = timeout_s
        self._token = token
        self._own_token: tuple[tuple[str, str], ...] | None = None
        self._login = login
        self._leases: dict[int, _Kept] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._failures = 0  # refreshes failed in a row (the first of a run is logged as a warning)

    def keep(self, lease_id: int, ttl_s: int, acknowledged_at: float, on_lost: Callable[[str], None]) -> None:
        """Refresh `lease_id` from now on; `acknowledged_at` (time.monotonic()) is when the request
        etcd last acknowledged for it was sent (the grant). `on_lost(reason)` runs in the keeper's thread."""
        with self._lock:
            self._leases[lease_id] = _Kept(lease_id, ttl_s, acknowledged_at + ttl_s, acknowledged_at + ttl_s / 3,
                                           on_lost)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="etcd lease keeper", daemon=True)
                self._thread.start()
        self._wake.set()

    def drop(self, lease_id: int) -> None:
        """Stop refreshing `lease_id` (revoked, or given up); its on_lost is not called."""
        with self._lock:
            self._leases.pop(lease_id, None)

    def close(self) -> None:
        """Stop the thread (an RPC in flight is cancelled) and close the channels. Blocks briefly."""
        with self._lock:
            self._stopping = True
            self._leases.clear()
            thread = self._thread
        self._wake.set()
        for channel in self._channels:
            channel.close()
        if thread is not None:
            thread.join(self._timeout_s)

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stopping:
                    return
                leases = list(self._leases.values())
            now = time.monotonic()
            for kept in leases:
                if now >= kept.expires_at:
                    self._lose(kept, f"no keepalive acknowledged for {kept.ttl_s} s")
                elif kept.next_send <= now:
                    self._refresh(kept)
            with self._lock:
                wake_at = min((min(k.next_send, k.expires_at) for k in self._leases.values()), default=None)
            self._wake.wait(None if wake_at is None else max(0.0, wake_at - time.monotonic()))
            self._wake.clear()

    def _refresh(self, kept: _Kept) -> None:
        sent_at = time.monotonic()
        try:
            reply = self._keepalive(kept.lease_id, max(0.05, min(self._timeout_s, kept.expires_at - sent_at)))
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            self._after_failure(code, f"{code.name if code else 'error'}: "
                                      f"{exc.details() if isinstance(exc, grpc.Call) else exc}")
            kept.next_send = time.monotonic() + _RETRY_S
            return
        if reply is None:
            self._after_failure(None, "etcd closed the keepalive stream without a reply")
            kept.next_send = time.monotonic() + _RETRY_S
        elif reply.TTL <= 0:
            self._lose(kept, "etcd reports it expired")
        else:
            self._failures = 0
            kept.expires_at = sent_at + reply.TTL
            kept.next_send = sent_at + reply.TTL / 3

    def _keepalive(self, lease_id: int, timeout_s: float) -> rpc.LeaseKeepAliveResponse | None:
        """One refresh on a stream of its own: a request, the reply (None when the stream ends first)."""
        stub = rpc.LeaseStub(self._channels[self._current])
        replies = stub.LeaseKeepAlive(iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]), timeout=timeout_s,
                                      metadata=self._metadata())
        try:
            return next(replies, None)
        finally:
            replies.cancel()

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return self._own_token if self._own_token is not None else self._token()

    def _after_failure(self, code: grpc.StatusCode | None, reason: str) -> None:
        """Move to the next member when this one is unreachable; log in for a fresh token when ours expired."""
        self._failures += 1
        log.log(logging.WARNING if self._failures == 1 else logging.DEBUG,
                "etcd lease keepalive to %s failed (%s); trying again", self._targets[self._current], reason)
        if code in _UNREACHABLE and len(self._channels) > 1:
            self._current = (self._current + 1) % len(self._channels)
        elif code == grpc.StatusCode.UNAUTHENTICATED and self._login is not None:
            name, password = self._login
            try:
                response = rpc.AuthStub(self._channels[self._current]).Authenticate(
                    rpc.AuthenticateRequest(name=name, password=password), timeout=self._timeout_s)
                self._own_token = (("token", response.token),)
            except grpc.RpcError as exc:
                log.warning("etcd lease keeper could not authenticate as %r: %s", name, exc)

    def _lose(self, kept: _Kept, reason: str) -> None:
        with self._lock:
            if self._leases.pop(kept.lease_id, None) is None:
                return  # dropped meanwhile
        kept.on_lost(reason)
