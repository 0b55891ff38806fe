"""The production Store: etcd v3 over our own grpc.aio channels, with aetcd's generated stubs.

aetcd.Client is not used because it dials one insecure endpoint. Here every endpoint gets its
own channel (so TLS checks each member's certificate against its own name), one of them is
current, and an unreachable member makes the store move on to the next one. Reads are retried
on the other members at once; writes are not (an UNAVAILABLE write may still have been
applied), so they raise StoreUnavailable and the caller re-reads and decides again.

Leases are refreshed at TTL/3 by a thread of their own over channels of their own
(daemon/store/lease_keeper.py), so a busy event loop cannot starve them. A lease is declared lost
when etcd answers TTL <= 0, or when no refresh has been acknowledged for a whole TTL counted from
the moment the last acknowledged request was sent, which is no later than etcd's own expiry of it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar, overload

import grpc
from aetcd import rpc

from common.grpc_keepalive import keepalive_options
from daemon.store.interface import (
    Fence,
    KeyValue,
    Lease,
    StoreError,
    StoreUnavailable,
    WatchCompacted,
    WatchEvent,
    WatchEventKind,
)
from daemon.store.lease_keeper import LeaseKeeper

log = logging.getLogger(__name__)

T = TypeVar("T")

# The member cannot serve us now: move to the next endpoint.
_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# A broken stream worth re-opening (etcd restarting, a proxy resetting the connection).
_STREAM_RETRYABLE = _UNREACHABLE | {
    grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.UNAUTHENTICATED,
}

# Keys a prefix read asks etcd for at once: a few hundred KB of records like trainerd's, well below what a
# response may carry (_CHANNEL_OPTIONS).
PREFIX_PAGE_KEYS = 1000

_CHANNEL_OPTIONS = [
    # gRPC's default backoff grows to 120 s between redials; a lease of a few seconds needs
    # the member back within a fraction of its TTL.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # Notice a member that stopped answering (frozen, or cut off: no FIN) under an idle watch, 15 s after it
    # was last heard, and re-open the watch on another. etcd refuses pings more often than every 5 s.
    *keepalive_options(ping_every_s=10, answer_within_s=5, without_calls=False),
    # Responses up to 64 MiB rather than gRPC's default 4 MiB: a page of PREFIX_PAGE_KEYS records averaging up
    # to 64 KiB each (trainerd's are a few hundred bytes).
    ("grpc.max_receive_message_length", 64 << 20),
]


async def _pause_before_reopening(failures: int, stream: str, reason: str) -> None:
    """Log the first of a run of failures as a warning, then back off 0.1, 0.2, 0.4, ... capped
    at 1 s."""
    level = logging.WARNING if failures == 1 else logging.DEBUG
    log.log(level, "etcd %s broke (%s); re-opening it", stream, reason)
    await asyncio.sleep(min(0.1 * 2 ** (failures - 1), 1.0))


def _prefix_range(prefix: str) -> tuple[bytes, bytes]:
    """etcd's (key, range_end) for every key that starts with `prefix`."""
    key = prefix.encode()
    for i in reversed(range(len(key))):
        if key[i] < 0xFF:
            return key, key[:i] + bytes([key[i] + 1])
    return key or b"\0", b"\0"  # range_end "\0": every key from `key` on


def _describe(exc: grpc.aio.AioRpcError) -> str:
    return f"{exc.code().name}: {exc.details()}"


def _wrap(exc: grpc.aio.AioRpcError, what: str) -> StoreError:
    kind = StoreUnavailable if exc.code() in _UNREACHABLE else StoreError
    return kind(f"etcd {what} failed: {_describe(exc)}")


def _key_value(kv: rpc.KeyValue) -> KeyValue:
    return KeyValue(kv.key.decode(), kv.value, kv.mod_revision, kv.create_revision, kv.lease)


def _watch_event(event: rpc.Event) -> WatchEvent:
    if event.type == rpc.Event.EventType.DELETE:
        return WatchEvent(WatchEventKind.DELETE, event.kv.key.decode(), b"", event.kv.mod_revision)
    return WatchEvent(WatchEventKind.PUT, event.kv.key.decode(), event.kv.value, event.kv.mod_revision)


def _read_file(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise StoreError(f"cannot read etcd {what} {path}: {exc.strerror}") from exc


def _targets_and_credentials(
    endpoints: list[str], ca_file: str | None, cert_file: str | None, key_file: str | None,
) -> tuple[list[str], grpc.ChannelCredentials | None]:
    """gRPC targets ("host:port") for `endpoints` ("host:port", "http://…" or "https://…"),
    and TLS credentials when a TLS file is given or an endpoint says https."""
    if not endpoints:
        raise ValueError("no etcd endpoints given")
    if (cert_file is None) != (key_file is None):
        raise ValueError("an etcd client certificate needs both cert_file and key_file")
    targets, schemes = [], set()
    for endpoint in endpoints:
        scheme, sep, rest = endpoint.partition("://")
        if sep and scheme not in ("http", "https"):
            raise ValueError(f"etcd endpoint {endpoint!r}: scheme must be http or https")
        schemes.add(scheme if sep else None)
        targets.append((rest if sep else endpoint).rstrip("/"))
    tls = "https" in schemes or any(f is not None for f in (ca_file, cert_file, key_file))
    if tls and "http" in schemes:
        raise ValueError(f"etcd endpoints {endpoints} mix http with TLS")
    if not tls:
        return targets, None
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read_file(ca_file, "CA file"),
        private_key=_read_file(key_file, "key file"),
        certificate_chain=_read_file(cert_file, "certificate file"),
    )
    return targets, credentials


@dataclass
class _Member:
    """One etcd endpoint: its channel and the stubs over it."""

    target: str
    channel: grpc.aio.Channel
    kv: rpc.KVStub
    lease: rpc.LeaseStub
    watch: rpc.WatchStub
    auth: rpc.AuthStub

    @classmethod
    def open(cls, target: str, credentials: grpc.ChannelCredentials | None) -> _Member:
        if credentials is None:
            channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
        else:
            channel = grpc.aio.secure_channel(target, credentials, options=_CHANNEL_OPTIONS)
        return cls(target, channel, rpc.KVStub(channel), rpc.LeaseStub(channel),
                   rpc.WatchStub(channel), rpc.AuthStub(channel))


class EtcdLease:
    def __init__(self, store: EtcdStore, lease_id: int, ttl_s: int) -> None:
        self.id = lease_id
        self.ttl_s = ttl_s
        self._store = store
        self._lost = asyncio.Event()
        # Set by the keeper's thread the moment it gives the lease up, before the loop hears of it.
        self._expired = threading.Event()

    @property
    def alive(self) -> bool:
        return not (self._lost.is_set() or self._expired.is_set())

    async def wait_lost(self) -> None:
        await self._lost.wait()

    async def revoke(self) -> None:
        await self._store._revoke_lease(self)

    def mark_lost(self) -> None:
        self._expired.set()
        self._lost.set()


class EtcdStore:
    """Use `await EtcdStore.connect(...)`; the constructor takes already-opened members."""

    def __init__(self, members: list[_Member], credentials: tuple[str, str] | None,
                 timeout_s: float, channel_credentials: grpc.ChannelCredentials | None = None) -> None:
        self._members = members
        self._current = 0
        self._credentials = credentials
        self._metadata: tuple[tuple[str, str], ...] = ()
        self._timeout_s = timeout_s
        self._leases: dict[int, EtcdLease] = {}
        self._keeper = LeaseKeeper([m.target for m in members], channel_credentials, _CHANNEL_OPTIONS, timeout_s,
                                   lambda: self._metadata, credentials)
        self._watch_calls: set[grpc.aio.StreamStreamCall] = set()
        self._closed = False

    @classmethod
    async def connect(
        cls,
        endpoints: list[str],
        *,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        username: str | None = None,
        password: str | None = None,
        timeout_s: float = 5.0,
    ) -> EtcdStore:
        """Open a channel to every endpoint and return once one of them answers (and the
        credentials, when given, are accepted); StoreUnavailable when none does in time."""
        if (username is None) != (password is None):
            raise ValueError("etcd authentication needs both username and password")
        targets, channel_credentials = _targets_and_credentials(endpoints, ca_file, cert_file, key_file)
        members = [_Member.open(target, channel_credentials) for target in targets]
        credentials = (username, password) if username is not None and password is not None else None
        store = cls(members, credentials, timeout_s, channel_credentials)
        try:
            await store._pick_reachable_member()
            if store._credentials is not None:
                await store._authenticate(store._credentials)
        except BaseException:
            await store.close()
            raise
        return store

    async def _pick_reachable_member(self) -> None:
        waits = {asyncio.ensure_future(m.channel.channel_ready()): i for i, m in enumerate(self._members)}
        done, pending = await asyncio.wait(waits, timeout=self._timeout_s,
                                           return_when=asyncio.FIRST_COMPLETED)
        for waiting in pending:
            waiting.cancel()
        if not done:
            targets = ", ".join(m.target for m in self._members)
            raise StoreUnavailable(f"no etcd endpoint answered within {self._timeout_s} s: {targets}")
        self._current = min(waits[w] for w in done)

    async def _authenticate(self, credentials: tuple[str, str]) -> None:
        name, password = credentials
        member = self._members[self._current]
        try:
            response = await member.auth.Authenticate(
                rpc.AuthenticateRequest(name=name, password=password), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _wrap(exc, f"authentication as {name!r} at {member.target}") from exc
        self._metadata = (("token", response.token),)

    def _fail_over(self, member: _Member) -> None:
        """`member` failed; make the next endpoint current (unless another caller already did)."""
        if len(self._members) > 1 and self._members[self._current] is member:
            self._current = (self._current + 1) % len(self._members)
            log.warning("etcd at %s is unreachable; trying %s", member.target,
                        self._members[self._current].target)

    @overload
    async def _call(self, what: str, method: Callable[[_Member], Callable[..., Awaitable[T]]],
                    request: object, *, idempotent: bool) -> T: ...

    @overload
    async def _call(self, what: str, method: Callable[[_Member], Callable[..., Awaitable[T]]],
                    request: object, *, idempotent: bool, already_done: grpc.StatusCode) -> T | None: ...

    async def _call(self, what: str, method: Callable[[_Member], Callable[..., Awaitable[T]]],
                    request: object, *, idempotent: bool,
                    already_done: grpc.StatusCode | None = None) -> T | None:
        """Send `request` to `method` of the current member (e.g. `lambda m: m.kv.Range`).

        Re-authenticates once when the token has expired; fails over when the member is
        unreachable and, when `idempotent`, tries the other members. An error with code
        `already_done` means there was nothing left to do: it returns None.
        """
        if self._closed:
            raise StoreError(f"etcd {what}: the store is closed")
        attempts = len(self._members) if idempotent else 1
        reauthenticated = False
        while True:
            member = self._members[self._current]
            try:
                return await method(member)(request, timeout=self._timeout_s, metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == already_done:
                    return None
                if (exc.code() == grpc.StatusCode.UNAUTHENTICATED and self._credentials is not None
                        and not reauthenticated):
                    reauthenticated = True
                    await self._authenticate(self._credentials)
                    continue
                if exc.code() in _UNREACHABLE:
                    self._fail_over(member)
                    attempts -= 1
                    if attempts > 0:
                        continue
                raise _wrap(exc, what) from exc

    # -- reads -------------------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        request = rpc.RangeRequest(key=key.encode())
        response = await self._call(f"get {key}", lambda m: m.kv.Range, request, idempotent=True)
        return _key_value(response.kvs[0]) if response.kvs else None

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under `prefix`, read PREFIX_PAGE_KEYS at a time, all pages at the first page's revision
        (one consistent view). In one response, 20,000 node records (4.2 MB) passed gRPC's 4 MiB limit on
        a received message, and a leader could not load the cluster it was to lead."""
        key, range_end = _prefix_range(prefix)
        found: list[KeyValue] = []
        revision = 0
        while True:
            request = rpc.RangeRequest(key=key, range_end=range_end, limit=PREFIX_PAGE_KEYS, revision=revision,
                                       sort_order=rpc.RangeRequest.SortOrder.ASCEND,
                                       sort_target=rpc.RangeRequest.SortTarget.KEY)
            response = await self._call(f"get prefix {prefix}", lambda m: m.kv.Range, request, idempotent=True)
            revision = revision or response.header.revision
            found.extend(_key_value(kv) for kv in response.kvs)
            if not response.more or not response.kvs:
                return found, revision
            key = response.kvs[-1].key + b"\0"  # the next key after the page's last

    async def get_range(self, start_key: str, end_key: str, *, limit: int,
                        descending: bool = False) -> tuple[list[KeyValue], int]:
        if limit < 1:
            raise ValueError(f"a ranged read needs a limit of at least 1, got {limit}")
        order = rpc.RangeRequest.SortOrder.DESCEND if descending else rpc.RangeRequest.SortOrder.ASCEND
        request = rpc.RangeRequest(key=start_key.encode(), range_end=end_key.encode(), limit=limit,
                                   sort_order=order, sort_target=rpc.RangeRequest.SortTarget.KEY)
        response = await self._call(f"get range {start_key} to {end_key}", lambda m: m.kv.Range, request,
                                    idempotent=True)
        return [_key_value(kv) for kv in response.kvs], response.header.revision

    # -- writes ------------------------------------------------------------------------------

    async def compare_and_swap(
        self,
        key: str,
        value: bytes,
        expected_mod_revision: int,
        *,
        lease: Lease | None = None,
        fence: Fence | None = None,
    ) -> int | None:
        put = rpc.PutRequest(key=key.encode(), value=value, lease=lease.id if lease else 0)
        request = rpc.TxnRequest(
            compare=self._compares(key, expected_mod_revision, fence),
            success=[rpc.RequestOp(request_put=put)])
        response = await self._call(f"compare-and-swap {key}", lambda m: m.kv.Txn, request,
                                    idempotent=False)
        return response.header.revision if response.succeeded else None

    async def delete(self, key: str, expected_mod_revision: int | None = None, *,
                     fence: Fence | None = None) -> bool:
        delete = rpc.DeleteRangeRequest(key=key.encode())
        return bool(await self._delete(delete, f"delete {key}", self._compares(key, expected_mod_revision, fence)))

    async def delete_range(self, start_key: str, end_key: str, *, fence: Fence | None = None) -> int | None:
        delete = rpc.DeleteRangeRequest(key=start_key.encode(), range_end=end_key.encode())
        return await self._delete(delete, f"delete range {start_key} to {end_key}",
                                  self._compares(start_key, None, fence))

    async def _delete(self, delete: rpc.DeleteRangeRequest, what: str, compares: list[rpc.Compare]) -> int | None:
        """How many keys `delete` removed; None when one of `compares` failed."""
        if not compares:
            response = await self._call(what, lambda m: m.kv.DeleteRange, delete, idempotent=False)
            return response.deleted
        request = rpc.TxnRequest(compare=compares, success=[rpc.RequestOp(request_delete_range=delete)])
        response = await self._call(what, lambda m: m.kv.Txn, request, idempotent=False)
        return response.responses[0].response_delete_range.deleted if response.succeeded else None

    @staticmethod
    def _compares(key: str, mod_revision: int | None, fence: Fence | None) -> list[rpc.Compare]:
        """etcd compares a missing key as mod revision 0, which is what "expected 0" means; None: any."""
        checks = ([] if mod_revision is None else [(key, mod_revision)]) + (
            [(fence.key, fence.mod_revision)] if fence else [])
        return [rpc.Compare(key=k.encode(), target=rpc.Compare.CompareTarget.MOD,
                            result=rpc.Compare.CompareResult.EQUAL, mod_revision=revision)
                for k, revision in checks]

    async def compact(self, revision: int) -> None:
        """Forget history before `revision`; returns once etcd has physically compacted."""
        await self._call(f"compact at {revision}", lambda m: m.kv.Compact,
                         rpc.CompactionRequest(revision=revision, physical=True), idempotent=True)

    # -- leases ------------------------------------------------------------------------------

    async def grant_lease(self, ttl_s: int) -> EtcdLease:
        sent_at = time.monotonic()
        response = await self._call(f"grant a {ttl_s} s lease", lambda m: m.lease.LeaseGrant,
                                    rpc.LeaseGrantRequest(TTL=ttl_s), idempotent=False)
        if response.error:
            raise StoreError(f"etcd refused a {ttl_s} s lease: {response.error}")
        lease = EtcdLease(self, response.ID, response.TTL)
        self._leases[lease.id] = lease
        loop = asyncio.get_running_loop()

        def lost(reason: str) -> None:  # in the keeper's thread
            lease._expired.set()
            try:
                loop.call_soon_threadsafe(self._lose_lease, lease, reason)
            except RuntimeError:  # the loop is closed: nobody is waiting
                pass

        self._keeper.keep(lease.id, response.TTL, sent_at, lost)
        return lease

    async def _revoke_lease(self, lease: EtcdLease) -> None:
        """Stop refreshing `lease` and revoke it in etcd, which deletes its keys. Idempotent."""
        self._lose_lease(lease)
        await self._call(f"revoke lease {lease.id:x}", lambda m: m.lease.LeaseRevoke,
                         rpc.LeaseRevokeRequest(ID=lease.id), idempotent=True,
                         already_done=grpc.StatusCode.NOT_FOUND)  # expired or revoked before

    def _lose_lease(self, lease: EtcdLease, reason: str | None = None) -> None:
        """Stop refreshing `lease` and wake its `wait_lost`; `reason` None: we gave it up."""
        self._keeper.drop(lease.id)
        lease.mark_lost()
        if self._leases.pop(lease.id, None) is not None and reason is not None:
            log.warning("etcd lease %x (TTL %d s) is lost: %s", lease.id, lease.ttl_s, reason)

    async def _prepare_to_reopen(self, member: _Member, exc: grpc.aio.AioRpcError) -> str:
        """A stream to `member` failed with `exc`: move on when the member is unreachable, get
        a fresh token when ours expired. Returns why the stream broke."""
        if exc.code() in _UNREACHABLE:
            self._fail_over(member)
        elif exc.code() == grpc.StatusCode.UNAUTHENTICATED and self._credentials is not None:
            try:
                await self._authenticate(self._credentials)
            except StoreError as auth_error:  # shows up again when the stream re-opens
                log.warning("%s", auth_error)
        return _describe(exc)

    # -- watches -----------------------------------------------------------------------------

    def watch_prefix(self, prefix: str, start_revision: int) -> AsyncGenerator[WatchEvent, None]:
        if start_revision < 1:
            raise ValueError(f"a watch starts at revision 1 or later, got {start_revision}")
        return self._watch(prefix, start_revision)

    async def _watch(self, prefix: str, next_revision: int) -> AsyncGenerator[WatchEvent, None]:
        key, range_end = _prefix_range(prefix)
        failures = 0
        while not self._closed:
            member = self._members[self._current]
            call = member.watch.Watch(metadata=self._metadata)
            self._watch_calls.add(call)
            try:
                await call.write(rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
                    key=key, range_end=range_end, start_revision=next_revision)))
                async for response in call:
                    failures = 0
                    if response.compact_revision:
                        raise WatchCompacted(
                            f"watch of {prefix} from revision {next_revision}: etcd has compacted "
                            f"its history up to {response.compact_revision}")
                    if response.canceled:
                        raise StoreError(f"etcd cancelled the watch of {prefix}: {response.cancel_reason}")
                    for event in response.events:
                        yield _watch_event(event)
                        next_revision = event.kv.mod_revision + 1
                reason = "etcd closed the stream"
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _STREAM_RETRYABLE:
                    raise _wrap(exc, f"watch of {prefix}") from exc
                reason = await self._prepare_to_reopen(member, exc)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # our consumer is being cancelled (or, outside a task, we cannot tell)
                reason = "the stream was cancelled"  # by close() or interrupt_watch_streams()
            except asyncio.InvalidStateError:
                reason = "the stream finished before the watch was created"
            finally:
                self._watch_calls.discard(call)
                call.cancel()
            if self._closed:
                return
            failures += 1
            await _pause_before_reopening(
                failures, f"watch of {prefix} (next revision {next_revision})", reason)

    def interrupt_watch_streams(self) -> int:
        """Test hook: break every open watch stream, as a dropped connection would. Returns how
        many were broken."""
        calls = list(self._watch_calls)
        for call in calls:
            call.cancel()
        return len(calls)

    async def close(self) -> None:
        """Stop the keepalive (the leases then expire in etcd after their TTL), end the watches
        and close the channels. Idempotent."""
        self._closed = True
        await asyncio.to_thread(self._keeper.close)
        for lease in list(self._leases.values()):
            self._lose_lease(lease)
        for member in self._members:
            await member.channel.close()
