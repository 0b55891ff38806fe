"""The coordinator's errors reach a real gRPC client as one table says, on every RPC (daemon/grpc_errors.py).

A real grpc.aio server on 127.0.0.1, built as `trainerd start` builds it, serves the real servicers
in front of a stand-in coordinator whose every call raises the error under test.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import pytest
from click.testing import CliRunner

from daemon.app import grpc_server
from daemon.cli.trainerctl import cli
from daemon.coordinator import (
    AgentSession,
    ClusterView,
    CoordinatorView,
    NotLeader,
    SessionRefused,
    Welcome,
)
from daemon.errors import PermanentError, RetryableError
from daemon.grpc_services import ControlService, CoordinatorService
from daemon.job.controller import CommandRefused
from daemon.job.skip_ledger import BadRange
from daemon.job.state import IllegalTransition
from daemon.peer_auth import PermissionDenied
from daemon.store.codec import BadValue
from daemon.store.interface import LeadershipLost, StoreError, StoreUnavailable
from proto import trainerd_pb2 as pb
from proto import trainerd_pb2_grpc as pb_grpc
from proto.vocabulary import LEADER_ADDRESS_METADATA

RPC_TIMEOUT_S = 5.0
LEADER = "10.0.0.2:7420"

CONTROL_CALLS = [
    ("GetStatus", pb.StatusRequest()),
    ("ListEvents", pb.EventsRequest()),
    ("Pause", pb.PauseRequest()),
    ("Resume", pb.ResumeRequest()),
    ("SetDrain", pb.DrainRequest(node="n1", drained=True)),
    ("ListSkips", pb.SkipsRequest()),
    ("AddSkip", pb.AddSkipRequest(start=1, end=2, reason="x")),
]
RPCS = [name for name, _ in CONTROL_CALLS] + ["Session"]


class UnlistedRetryable(RetryableError):
    """A retryable error the table has no row for."""


class UnlistedPermanent(PermanentError):
    """A permanent error the table has no row for."""


class StandInCoordinator:
    """What the servicers call; each call raises `error` when it is set, else answers."""

    def __init__(self, address: str = "127.0.0.1:1", *, is_leader: bool = True) -> None:
        self.error: Exception | None = None
        self._address = address
        self._is_leader = is_leader

    def _answer(self, value):
        if self.error is not None:
            raise self.error
        return value

    def needs_recording(self, hello) -> bool:
        return True

    async def open_session(self, hello, send):
        return self._answer((AgentSession(hello.node_name, "token", send),
                             Welcome(hello.node_name, "token", 1.0, "stand-in")))

    def close_session(self, session: AgentSession) -> None:
        session.closed.set()

    async def view(self) -> ClusterView:
        return self._answer(ClusterView(CoordinatorView("stand-in", self._address, self._is_leader, "stand-in",
                                                        self._address), (), None))

    async def events(self, after_seq: int, limit: int) -> list:
        return self._answer([])

    async def pause(self, now: bool = False) -> str:
        return self._answer("paused")

    async def resume(self, from_step: int | None) -> str:
        return self._answer("resumed")

    async def set_drain(self, node: str, drained: bool) -> str:
        return self._answer(f"node {node} is drained")

    async def add_skip(self, start: int, end: int, reason: str) -> str:
        return self._answer(f"samples {start}:{end} are skipped")

    async def skips(self) -> tuple:
        return self._answer(())


@dataclass(frozen=True)
class Answer:
    code: grpc.StatusCode
    details: str
    metadata: dict[str, str]


@asynccontextmanager
async def serving(coordinator: StandInCoordinator) -> AsyncIterator[str]:
    server = grpc_server()
    port = server.add_insecure_port("127.0.0.1:0")
    pb_grpc.add_CoordinatorServicer_to_server(CoordinatorService(coordinator), server)
    pb_grpc.add_ControlServicer_to_server(ControlService(coordinator), server)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def _failure(exc: grpc.aio.AioRpcError) -> Answer:
    return Answer(exc.code(), exc.details() or "", {key: value for key, value in exc.trailing_metadata() or ()})


async def call(address: str, rpc: str, first: pb.AgentMessage | None = None) -> Answer:
    """One RPC; for Session, the answer to its first message (a Hello unless `first` is given)."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            if rpc != "Session":
                request = dict(CONTROL_CALLS)[rpc]
                reply = await getattr(pb_grpc.ControlStub(channel), rpc)(request, timeout=RPC_TIMEOUT_S)
                return Answer(grpc.StatusCode.OK, getattr(reply, "message", ""), {})
            session = pb_grpc.CoordinatorStub(channel).Session(timeout=RPC_TIMEOUT_S)
            await session.write(first or pb.AgentMessage(hello=pb.Hello(node_name="n1", host="10.0.0.1")))
            reply = await session.read()
            session.cancel()
            return Answer(grpc.StatusCode.OK, reply.WhichOneof("body"), {})
        except grpc.aio.AioRpcError as exc:
            return _failure(exc)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def answers_to(error: Exception) -> dict[str, Answer]:
    coordinator = StandInCoordinator()
    coordinator.error = error
    async with serving(coordinator) as address:
        return {rpc: await call(address, rpc) for rpc in RPCS}


@pytest.mark.parametrize(("error", "code", "details"), [
    (StoreUnavailable("no etcd endpoint answered within 5 s"), grpc.StatusCode.UNAVAILABLE,
     "etcd is unavailable: no etcd endpoint answered within 5 s"),
    (StoreError("etcd get: the store is closed"), grpc.StatusCode.UNAVAILABLE,
     "etcd failed: etcd get: the store is closed"),
    (BadValue("/trainerd/v1/leader", "not JSON"), grpc.StatusCode.FAILED_PRECONDITION,
     "etcd holds a value this trainerd cannot read: bad value at /trainerd/v1/leader: not JSON"),
    (NotLeader(LEADER), grpc.StatusCode.UNAVAILABLE, f"not the leader; the leader is at {LEADER}"),
    (LeadershipLost("/trainerd/v1/leader changed: this coordinator no longer leads"), grpc.StatusCode.UNAVAILABLE,
     "this coordinator just lost leadership; retry"),
    (CommandRefused("job j is COMPLETED; nothing to pause"), grpc.StatusCode.FAILED_PRECONDITION,
     "job j is COMPLETED; nothing to pause"),
    (BadRange("sample range 5:5 is empty or negative"), grpc.StatusCode.INVALID_ARGUMENT,
     "sample range 5:5 is empty or negative"),
    (SessionRefused("node name n1 is held by a live session"), grpc.StatusCode.FAILED_PRECONDITION,
     "node name n1 is held by a live session"),
    (PermissionDenied("operator bob is read-only: Pause needs a full operator certificate"),
     grpc.StatusCode.PERMISSION_DENIED, "operator bob is read-only: Pause needs a full operator certificate"),
    (IllegalTransition("job cannot go from COMPLETED to RUNNING"), grpc.StatusCode.INTERNAL,
     "trainerd refused an illegal job state change (a bug): job cannot go from COMPLETED to RUNNING"),
    (UnlistedRetryable("try again soon"), grpc.StatusCode.UNAVAILABLE, "try again soon"),
    (UnlistedPermanent("never works"), grpc.StatusCode.FAILED_PRECONDITION, "never works"),
], ids=lambda value: type(value).__name__ if isinstance(value, Exception) else None)
def test_each_domain_error_reaches_the_client_as_its_status(error: Exception, code: grpc.StatusCode,
                                                            details: str) -> None:
    answers = run(answers_to(error))
    assert {rpc: (a.code, a.details) for rpc, a in answers.items()} == {rpc: (code, details) for rpc in RPCS}


@pytest.mark.parametrize(("leader", "attached"), [(LEADER, LEADER), (None, "")])
def test_not_leader_always_attaches_the_leader_address(leader: str | None, attached: str) -> None:
    answers = run(answers_to(NotLeader(leader)))
    assert {rpc: a.metadata.get(LEADER_ADDRESS_METADATA) for rpc, a in answers.items()} == {
        rpc: attached for rpc in RPCS}


def test_lost_leadership_is_not_reported_as_an_etcd_problem() -> None:
    assert not issubclass(LeadershipLost, StoreError)
    answers = run(answers_to(LeadershipLost("/trainerd/v1/leader changed: this coordinator no longer leads")))
    for rpc, answer in answers.items():
        assert answer.code is grpc.StatusCode.UNAVAILABLE, rpc
        assert "etcd" not in answer.details, (rpc, answer.details)


def test_an_unexpected_error_is_internal_logged_and_the_server_keeps_answering(caplog) -> None:
    async def scenario() -> None:
        coordinator = StandInCoordinator()
        async with serving(coordinator) as address:
            coordinator.error = KeyError("gen-3")
            with caplog.at_level(logging.ERROR, logger="daemon.grpc_errors"):
                failed = {rpc: await call(address, rpc) for rpc in RPCS}
            coordinator.error = None
            recovered = {rpc: (await call(address, rpc)).code for rpc in RPCS}
        for rpc, answer in failed.items():
            assert answer.code is grpc.StatusCode.INTERNAL, rpc
            assert answer.details == ("internal error (KeyError: 'gen-3'); the coordinator's log has the "
                                      "traceback"), rpc
        logged = [r for r in caplog.records if r.name == "daemon.grpc_errors"]
        assert [r.exc_info[0] for r in logged] == [KeyError] * len(RPCS)
        assert recovered == {rpc: grpc.StatusCode.OK for rpc in RPCS}

    run(scenario())


def test_a_servicers_own_refusal_passes_through_unchanged(caplog) -> None:
    async def scenario() -> Answer:
        async with serving(StandInCoordinator()) as address:
            return await call(address, "Session", pb.AgentMessage(heartbeat=pb.Heartbeat()))

    with caplog.at_level(logging.DEBUG, logger="daemon.grpc_errors"):
        answer = run(scenario())
    assert (answer.code, answer.details) == (grpc.StatusCode.INVALID_ARGUMENT, "a session must start with Hello")
    assert [r for r in caplog.records if r.name == "daemon.grpc_errors"] == []


OPERATOR_COMMANDS = [("pause",), ("resume",), ("nodes", "drain", "n1"), ("skips", "add", "1:2", "--reason", "x"),
                     ("skips",)]


def refuse_commands(coordinator: StandInCoordinator, error: Exception) -> None:
    """The operator commands raise `error`; status and events still answer."""

    async def refuse(*args, **kwargs):
        raise error

    for command in ("pause", "resume", "set_drain", "add_skip", "skips"):
        setattr(coordinator, command, refuse)


async def trainerctl(address: str, *argv: str):
    return await asyncio.to_thread(CliRunner().invoke, cli, ["--coordinator", address, *argv])


@pytest.mark.parametrize("argv", OPERATOR_COMMANDS, ids=" ".join)
def test_trainerctl_follows_a_standby_to_the_leader(argv: tuple[str, ...]) -> None:
    """The status named a coordinator that has just stood down; its NotLeader names the new leader."""

    async def scenario():
        async with serving(StandInCoordinator()) as leader_address:
            stale = StandInCoordinator(is_leader=True)
            refuse_commands(stale, NotLeader(leader_address))
            async with serving(stale) as stale_address:
                return await trainerctl(stale_address, *argv)

    result = run(scenario())
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(("error", "exit_code", "fragment"), [
    (CommandRefused("job j is COMPLETED; nothing to pause"), 1, "Error: job j is COMPLETED; nothing to pause"),
    (BadRange("sample range 5:5 is empty or negative"), 1, "Error: sample range 5:5 is empty or negative"),
    (LeadershipLost("fence broke"), 3, "UNAVAILABLE this coordinator just lost leadership; retry"),
    (NotLeader(None), 3, "UNAVAILABLE not the leader; the leader is at an unknown address"),
    (StoreUnavailable("no etcd endpoint answered"), 3, "etcd is unavailable: no etcd endpoint answered"),
], ids=lambda value: type(value).__name__ if isinstance(value, Exception) else None)
def test_trainerctl_keeps_its_exit_codes(error: Exception, exit_code: int, fragment: str) -> None:
    async def scenario():
        coordinator = StandInCoordinator()
        refuse_commands(coordinator, error)
        async with serving(coordinator) as address:
            return await trainerctl(address, "pause")

    result = run(scenario())
    assert result.exit_code == exit_code, result.output
    assert fragment in result.output
    assert "Traceback" not in result.output
