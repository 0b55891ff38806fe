"""Who may call what when the coordinator serves TLS: the one place a client certificate becomes a permission.

The TLS layer has verified the client's certificate against the cluster's CA before any method runs;
`PeerAuthorizationInterceptor` reads whom it names (`common.cert_identity.peer_identity`) and checks it against
METHOD_ACCESS: an agent's Session needs a node certificate, looking at the cluster an operator certificate,
changing it a full (not read-only) operator certificate. A method missing from the table is refused, so
a new RPC stays closed until someone decides who may call it. Once the Session servicer has read the
Hello it calls `require_node`, so an agent speaks only for the node its certificate names.

A certificate also gets a fair share of the server: at most STREAMS_PER_CERTIFICATE of the calls that stay
open (STREAMS: an agent's Session, a probe's Health/Watch) at once, counted from before the Hello, so that one
certificate's idle streams cannot hold `max_sessions` against every other node (common/stream_quota.py). One
more is refused RESOURCE_EXHAUSTED.

Without TLS (loopback, or `insecure: true`) the interceptor is not installed: there is no identity, and
`require_node` lets every name through, as before certificates existed.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import inspect
import logging
from contextvars import ContextVar
from typing import Any

import grpc
from google.protobuf.message import Message

from common.cert_identity import CertificateError, PeerIdentity, PeerKind, peer_identity
from common.stream_quota import QuotaExceeded, StreamQuota
from daemon.errors import PermanentError, RetryableError
from daemon.method_handlers import Behavior, WrappingInterceptor
from daemon.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)

# How long a refused stream's first message is waited for (_take_first_message): an agent writes its Hello
# at once.
FIRST_MESSAGE_WAIT_S = 5.0
# Streams one certificate may hold open at once: an agent needs one Session, and a second while the coordinator
# has not yet noticed that the connection of its first is gone; the rest is room for a probe's Health/Watch.
STREAMS_PER_CERTIFICATE = 4


class PermissionDenied(PermanentError):
    """The client's certificate does not allow this call: use a certificate of the right kind (node,
    operator, full operator) or for the right node."""


class TooManyStreams(RetryableError):
    """The client's certificate already holds as many streams open here as one certificate may: end one
    (or wait until the coordinator notices that a connection is gone), then retry."""


class Access(enum.Enum):
    NODE = "an agent's node certificate"
    READ = "an operator certificate"
    WRITE = "a full (not read-only) operator certificate"
    ANY = "any certificate of the cluster"


METHOD_ACCESS: dict[str, Access] = {
    "/trainerd.v1.Coordinator/Session": Access.NODE,
    **{f"/trainerd.v1.Control/{name}": Access.READ for name in ("GetStatus", "ListEvents", "ReadLog", "ListSkips",
                                                                "ListTokens")},
    **{f"/trainerd.v1.Control/{name}": Access.WRITE for name in ("Pause", "Resume", "SetDrain", "AddSkip",
                                                                 "CreateToken", "DeleteToken", "RevokeNode")},
    "/grpc.health.v1.Health/Check": Access.ANY,
    "/grpc.health.v1.Health/Watch": Access.ANY,
}

# The methods whose calls stay open, counted against STREAMS_PER_CERTIFICATE.
STREAMS = frozenset({"/trainerd.v1.Coordinator/Session", "/grpc.health.v1.Health/Watch"})

# Whom the certificate of the call being served names; None without TLS.
_PEER: ContextVar[PeerIdentity | None] = ContextVar("trainerd_peer", default=None)


def authorize(method: str, certificates: list[bytes]) -> PeerIdentity:
    """Whom the verified client certificate (`certificates[0]`, PEM) names, when it may call `method`;
    PermissionDenied, one line, otherwise."""
    if not certificates:
        raise PermissionDenied("the client presented no certificate")
    try:
        identity = peer_identity(certificates[0])
    except CertificateError as exc:
        raise PermissionDenied(str(exc)) from None
    access = METHOD_ACCESS.get(method)
    name = method.rsplit("/", 1)[-1]
    if access is None:
        raise PermissionDenied(f"{method[:100]!r} is open to no certificate")
    if access is Access.WRITE and identity.read_only:
        raise PermissionDenied(f"operator {identity.name} is read-only: {name} needs {access.value}")
    allowed = {
        Access.NODE: identity.kind is PeerKind.NODE,
        Access.READ: identity.kind is PeerKind.OPERATOR,
        Access.WRITE: identity.kind is PeerKind.OPERATOR,
        Access.ANY: True,
    }[access]
    if not allowed:
        raise PermissionDenied(f"the certificate of {identity.kind.value} {identity.name} cannot call {name}: "
                               f"it needs {access.value}")
    return identity


def require_node(node_name: str) -> None:
    """PermissionDenied unless the call's certificate (if any) is the node certificate of `node_name`."""
    identity = _PEER.get()
    if identity is not None and identity.name != node_name:
        raise PermissionDenied(f"the certificate of node {identity.name} cannot open a session as node {node_name}")


async def _take_first_message(context: grpc.aio.ServicerContext) -> None:
    """Read a refused stream's first message before the refusal ends the call: a client whose first write
    meets a stream already ended sees INTERNAL ("Internal error from Core"), not the refusal that says which
    certificate to use (grpc/grpc#36066; the Session servicer reads the Hello first for the same reason).
    At most FIRST_MESSAGE_WAIT_S, and whatever the read ends in, the refusal follows."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(FIRST_MESSAGE_WAIT_S):
            await context.read()


def _checked(behavior: Behavior, method: str, quota: StreamQuota, warnings: RateLimitedLog) -> Behavior:
    """`behavior`, run only after `authorize` admitted the call, and for a stream of STREAMS only while
    the certificate holds no more than its share of them; a coroutine finds the identity in _PEER (an
    async generator, Health/Watch, needs none)."""
    def admit(context: grpc.aio.ServicerContext, held: contextlib.ExitStack) -> PeerIdentity:
        identity = authorize(method, context.auth_context().get("x509_pem_cert", []))
        if method in STREAMS:
            try:
                held.enter_context(quota.held(identity, f"{identity.kind.value} {identity.name}"))
            except QuotaExceeded as exc:
                warnings.warning(identity.uri, "refused a %s stream: %s", method.rsplit("/", 1)[-1], exc)
                raise TooManyStreams(str(exc)) from None
        return identity

    if inspect.isasyncgenfunction(behavior):
        async def streaming(request: Any, context: grpc.aio.ServicerContext):
            with contextlib.ExitStack() as held:
                admit(context, held)
                async for response in behavior(request, context):
                    yield response
        return streaming

    async def call(request: Any, context: grpc.aio.ServicerContext):
        with contextlib.ExitStack() as held:
            try:
                identity = admit(context, held)
            except (PermissionDenied, TooManyStreams):
                if not isinstance(request, Message):  # a request stream (an agent's Session)
                    await _take_first_message(context)
                raise
            token = _PEER.set(identity)
            try:
                return await behavior(request, context)
            finally:
                _PEER.reset(token)
    return call


class PeerAuthorizationInterceptor(WrappingInterceptor):
    """Checks every call's client certificate against METHOD_ACCESS, and its open streams against
    `streams_per_certificate`, before the servicer runs. Install it after ErrorStatusInterceptor (which then
    answers its PermissionDenied and TooManyStreams) and only on a TLS server that requires client
    certificates."""

    def __init__(self, streams_per_certificate: int = STREAMS_PER_CERTIFICATE) -> None:
        super().__init__(functools.partial(_checked, quota=StreamQuota(streams_per_certificate),
                                           warnings=RateLimitedLog(log)))
