"""Domain errors become gRPC status codes here: one table, applied to every RPC by one interceptor.

Servicers (daemon/grpc_services.py) let the coordinator's errors propagate; `ErrorStatusInterceptor`
turns each into the status code and the one-line message the caller sees. The table is looked up
along the error's class hierarchy, so a new `RetryableError` or `PermanentError` gets a sensible
code before it gets a row of its own. Anything else is a bug: it is logged with its traceback and
answered with INTERNAL, and the server carries on.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from daemon.admission import HelloDeferred
from daemon.coordinator import NotLeader, SessionRefused
from daemon.errors import PermanentError, RetryableError
from daemon.job.controller import CommandRefused
from daemon.job.skip_ledger import BadRange
from daemon.job.state import IllegalTransition
from daemon.method_handlers import WrappingInterceptor
from daemon.peer_auth import PermissionDenied, TooManyStreams
from daemon.store.codec import BadValue
from daemon.store.interface import LeadershipLost, StoreError, StoreUnavailable
from proto.vocabulary import LEADER_ADDRESS_METADATA, RETRY_AFTER_MS_METADATA

log = logging.getLogger(__name__)

Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Status:
    """What a failed RPC answers: a code, a one-line message, and trailing metadata."""

    code: grpc.StatusCode
    details: str
    trailing_metadata: Metadata = ()


def _no_metadata(exc: Exception) -> Metadata:
    return ()


@dataclass(frozen=True)
class StatusRule:
    """A row of the table: the code, and the message and metadata made from the error."""

    code: grpc.StatusCode
    details: Callable[[Any], str]
    trailing_metadata: Callable[[Any], Metadata] = _no_metadata


def _leader_address(exc: NotLeader) -> Metadata:
    """Always sent, empty when the leader is unknown, so every client can follow it the same way."""
    return ((LEADER_ADDRESS_METADATA, exc.leader_address or ""),)


def _retry_after(exc: HelloDeferred) -> Metadata:
    return ((RETRY_AFTER_MS_METADATA, str(round(exc.retry_after_s * 1000))),)


STATUS_TABLE: dict[type[Exception], StatusRule] = {
    HelloDeferred: StatusRule(grpc.StatusCode.RESOURCE_EXHAUSTED, str, _retry_after),
    NotLeader: StatusRule(grpc.StatusCode.UNAVAILABLE, str, _leader_address),
    LeadershipLost: StatusRule(grpc.StatusCode.UNAVAILABLE,
                               lambda exc: "this coordinator just lost leadership; retry"),
    StoreUnavailable: StatusRule(grpc.StatusCode.UNAVAILABLE, lambda exc: f"etcd is unavailable: {exc}"),
    BadValue: StatusRule(grpc.StatusCode.FAILED_PRECONDITION,
                         lambda exc: f"etcd holds a value this trainerd cannot read: {exc}"),
    StoreError: StatusRule(grpc.StatusCode.UNAVAILABLE, lambda exc: f"etcd failed: {exc}"),
    SessionRefused: StatusRule(grpc.StatusCode.FAILED_PRECONDITION, str),
    PermissionDenied: StatusRule(grpc.StatusCode.PERMISSION_DENIED, str),
    TooManyStreams: StatusRule(grpc.StatusCode.RESOURCE_EXHAUSTED, str),
    CommandRefused: StatusRule(grpc.StatusCode.FAILED_PRECONDITION, str),
    BadRange: StatusRule(grpc.StatusCode.INVALID_ARGUMENT, str),
    IllegalTransition: StatusRule(grpc.StatusCode.INTERNAL,
                                  lambda exc: f"trainerd refused an illegal job state change (a bug): {exc}"),
    RetryableError: StatusRule(grpc.StatusCode.UNAVAILABLE, str),
    PermanentError: StatusRule(grpc.StatusCode.FAILED_PRECONDITION, str),
}


def status_for(exc: Exception) -> Status:
    """The status an RPC that raised `exc` answers with (INTERNAL for an error not in the table)."""
    for kind in type(exc).__mro__:
        rule = STATUS_TABLE.get(kind)
        if rule is not None:
            return Status(rule.code, rule.details(exc), rule.trailing_metadata(exc))
    first_line = (str(exc).splitlines() or [""])[0]
    return Status(grpc.StatusCode.INTERNAL,
                  f"internal error ({type(exc).__name__}: {first_line}); the coordinator's log has the traceback")


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    status = status_for(exc)
    if status.code is grpc.StatusCode.INTERNAL:
        log.error("%s failed: %s", method, status.details, exc_info=exc)
    else:
        log.debug("%s answered %s: %s", method, status.code.name, status.details)
    await context.abort(status.code, status.details, trailing_metadata=status.trailing_metadata)


def _mapped(behavior: Callable[[Any, grpc.aio.ServicerContext], Any], method: str):
    """`behavior` with every exception it raises turned into its status; a servicer's own
    `context.abort` (AbortError) passes through untouched."""
    if inspect.isasyncgenfunction(behavior):
        async def streaming(request: Any, context: grpc.aio.ServicerContext):
            try:
                async for response in behavior(request, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - every error becomes a status; the server must not die
                await _abort(context, method, exc)
        return streaming

    async def call(request: Any, context: grpc.aio.ServicerContext):
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes a status; the server must not die
            await _abort(context, method, exc)
    return call


class ErrorStatusInterceptor(WrappingInterceptor):
    """Applies STATUS_TABLE to every method of every service on the server (all are coroutines or
    async generators, as grpc.aio servicers are)."""

    def __init__(self) -> None:
        super().__init__(_mapped)
