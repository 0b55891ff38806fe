"""The agent's one Session stream to the coordinator: Hello, heartbeats, reports, commands.

The agent dials out, finds the leader among the configured coordinators (a standby refuses
with the leader's address), and reconnects with jittered exponential backoff, presenting its
resume token so it keeps its identity across a coordinator failover or its own restart. The leader
acknowledges every heartbeat; the link notes each answer in `contact` (agent/fence.py), and gives up a
session that goes unanswered for about half the heartbeat timeout (a cut link breaks no connection).

This is the agent's edge for what the coordinator sends: each command is converted here into the agent's own
values (agent/commands.py) before the handler sees it. Reports go out as the protobuf they are sent as.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
from collections import deque
from pathlib import Path
from typing import Protocol

import grpc

from agent.commands import Command, command_from
from agent.fence import ContactWatch, FenceTerms
from common.atomic_write import write_atomically
from common.clock import Clock
from common.grpc_keepalive import keepalive_options
from common.tls_files import unnamed_address_hint
from proto import trainerd_pb2 as pb
from proto import trainerd_pb2_grpc as pb_grpc
from proto.vocabulary import (
    LEADER_ADDRESS_METADATA,
    MAX_RETRY_AFTER_S,
    MAX_WELCOME_WAIT_S,
    RETRY_AFTER_MS_METADATA,
    RETRY_AFTER_SPREAD,
)

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    # A coordinator that stops answering pings (frozen, or its host cut off) ends the call 30 s after the
    # last thing heard, well within the Welcome wait (with gRPC's own ping timeout it held a Hello 70 s).
    # Not shorter: in a connect burst a starved coordinator has left bytes unread for 4 s and more
    # (bench/heartbeats.py), and a ping it answers late breaks nothing.
    *keepalive_options(ping_every_s=10, answer_within_s=20, without_calls=True),
    ("grpc.enable_retries", 0),
    # A channel of its own connection: from the process-wide pool a new channel can be handed the closed
    # one's connection while that is still being torn down, and a redial after a cut link would then wait
    # on the dead connection it meant to leave (seen in test_coordinator_link under load).
    ("grpc.use_local_subchannel_pool", 1),
]
BACKOFF_BASE_S = 0.2
BACKOFF_CAP_S = 5.0
MAX_INTERVAL_S = 600.0  # the longest heartbeat interval a Welcome or an ack may ask for
MAX_STOP_GRACE_S = 3600.0  # the longest grace a Welcome may give the processes to stop (the cluster file: 300)


def backoff_delay(attempt: int, rng: random.Random, cap_s: float = BACKOFF_CAP_S,
                  retry_after_s: float = 0.0) -> float:
    """Jittered exponential backoff, so a restarted coordinator is not hit by every agent at once.
    A coordinator that deferred our Hello named when to come back (`retry_after_s`): no earlier than
    that, spread over half as long again so the deferred agents do not return together."""
    delay = rng.uniform(0.5, 1.0) * min(cap_s, BACKOFF_BASE_S * (2 ** attempt))
    if retry_after_s > 0:
        delay = max(delay, retry_after_s * rng.uniform(1.0, RETRY_AFTER_SPREAD))
    return delay


def _sane_pace(interval_s: float, timeout_s: float) -> bool:
    """Whether a coordinator's heartbeat pace can be kept: a finite interval of at most MAX_INTERVAL_S, and a
    timeout of at least two intervals."""
    return (math.isfinite(interval_s) and math.isfinite(timeout_s) and 0 < interval_s <= MAX_INTERVAL_S
            and 2 * interval_s <= timeout_s)


def _unusable_terms(welcome: pb.Welcome) -> str | None:
    """What of a Welcome's terms the agent cannot keep to (a few words), or None. A timeout of 0 is a leader
    that acknowledges no heartbeats: no fencing."""
    interval, timeout, grace = welcome.heartbeat_interval_s, welcome.heartbeat_timeout_s, welcome.stop_grace_s
    if not _sane_pace(interval, timeout if timeout != 0 else 2 * interval):
        return f"heartbeat interval {interval!r:.20} and timeout {timeout!r:.20}"
    if not (math.isfinite(grace) and 0 <= grace <= MAX_STOP_GRACE_S):
        return f"stop grace {grace!r:.20}"
    return None


async def _write_first(call: grpc.aio.StreamStreamCall, message: pb.AgentMessage) -> None:
    """Write a session's first message. A call the coordinator ended before it (a refusal, a coordinator
    stopping) raises its status as AioRpcError, as a refusal read later would: grpc.aio raises
    InvalidStateError ("RPC already finished"), which says neither why nor when to come back."""
    try:
        await call.write(message)
    except asyncio.InvalidStateError:
        raise grpc.aio.AioRpcError(await call.code(), await call.initial_metadata(), await call.trailing_metadata(),
                                   await call.details()) from None


def retry_after_s(exc: grpc.aio.AioRpcError) -> float:
    """The coordinator's hint of when to try again (0: none)."""
    hint = dict(exc.trailing_metadata() or ()).get(RETRY_AFTER_MS_METADATA)
    try:
        return min(MAX_RETRY_AFTER_S, max(0.0, float(hint) / 1000)) if hint else 0.0
    except ValueError:
        return 0.0


def redial_after_s(interval_s: float, timeout_s: float) -> float:
    """How long a session may go unanswered before the agent dials again: well before it fences itself
    and before the leader declares it LOST (both after `timeout_s`), so a stream that died without an
    error costs a redial, not the generation. (Seen once in CI: after the leader's SIGKILL one agent's
    stream never failed, and the new leader declared that node LOST.)"""
    return min(timeout_s, max(3 * interval_s, timeout_s / 2))


class IdentityFile:
    """The resume token survives an agent restart, so a quick restart keeps the node's session."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def load_token(self, node_name: str) -> str:
        try:
            data = json.loads(self._path.read_text())
        except (OSError, ValueError):
            return ""
        return data.get("resume_token", "") if data.get("node_name") == node_name else ""

    def save_token(self, node_name: str, token: str) -> None:
        # The token lets its holder take this node's session: owner-only, whatever the umask.
        write_atomically(self._path, json.dumps({"node_name": node_name, "resume_token": token}).encode(), 0o600)


class SessionHandler(Protocol):
    """What the link asks of the agent while a session runs."""

    def on_command(self, command: Command) -> None:
        """A Launch, Stop, CheckpointNow, RequestExit, ReadLog, NodeCheck, Revocations or NodeCertificate from the
        coordinator (agent/commands.py); must not block."""

    def heartbeat_body(self) -> pb.Heartbeat:
        """The next heartbeat (the link fills in its sequence number)."""

    def on_connected(self, connected: bool) -> None:
        """The session was established (True) or has ended (False). What is sent from here on True goes
        out on the new session before its first heartbeat (the agent re-sends its newest reports: the
        coordinator that now leads may never have had them)."""


class CoordinatorLink:
    """Reports go out through `send` from anywhere; `run(handler)` keeps the session open.

    The handler is given to `run`, not to the constructor, so the supervisor can be built with
    `link.send` as its report sink before the agent that handles commands exists.
    """

    def __init__(
        self,
        *,
        addresses: list[str],
        hello: pb.Hello,
        identity: IdentityFile,
        clock: Clock,
        rng: random.Random | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        welcome_timeout_s: float = MAX_WELCOME_WAIT_S,
    ) -> None:
        """`credentials`: TLS (the cluster's CA, this node's certificate); None talks plain text.
        `welcome_timeout_s`: how long an attempt waits for its Welcome (`_session_on`)."""
        self._addresses = addresses
        self._credentials = credentials
        self._hello = hello
        self._identity = identity
        self._clock = clock
        self._rng = rng or random.Random()
        # Reports not yet written, oldest first. One leaves only once written, by whichever task holds the
        # turn to write: a report taken out before its turn could be overtaken by a heartbeat built after it
        # (a heartbeat showing a process exited before the exit report carrying its log and cause), and
        # would be lost if the session broke meanwhile.
        self._outbox: deque[pb.AgentMessage] = deque()
        self._queued = asyncio.Event()
        self._leader_hint: str | None = None
        # Once we know the heartbeat interval, never wait longer than it between attempts: a new
        # leader gives known nodes one heartbeat timeout to come back before it declares them LOST.
        self._backoff_cap_s = BACKOFF_CAP_S
        self.connected = asyncio.Event()
        self.welcome: pb.Welcome | None = None
        # The session's heartbeat interval: the Welcome's, then whatever each ack names (the leader
        # stretches it as it holds more agents: daemon/heartbeat_pace.py).
        self.interval_s = 1.0
        # When a coordinator last answered: the agent fences itself when that is too long ago.
        self.contact = ContactWatch(clock)
        # The channel of an attempt the coordinator deferred, kept for the next attempt to it (`_channel_to`).
        self._kept: tuple[str, grpc.aio.Channel] | None = None
        self._welcome_timeout_s = welcome_timeout_s

    def use_credentials(self, credentials: grpc.ChannelCredentials) -> None:
        """From the next dial on (a renewed node certificate); the open session goes on with the old one."""
        self._credentials = credentials

    def send(self, message: pb.AgentMessage) -> None:
        """Queue a report; it goes out on the current session, or the next one."""
        self._outbox.append(message)
        self._queued.set()

    async def _write_queued(self, call) -> None:
        """Writes every queued report in order; the caller holds the turn to write. One whose write fails
        stays queued for the next session (the coordinator takes a report told twice as told once)."""
        while self._outbox:
            await call.write(self._outbox[0])
            self._outbox.popleft()

    def _next_address(self, attempt: int) -> str:
        if self._leader_hint:
            hint, self._leader_hint = self._leader_hint, None
            return hint
        return self._addresses[attempt % len(self._addresses)]

    async def run(self, handler: SessionHandler) -> None:
        """Keep a session open until cancelled."""
        try:
            await self._keep_a_session(handler)
        finally:
            kept, self._kept = self._kept, None
            if kept is not None:
                await kept[1].close()

    async def _keep_a_session(self, handler: SessionHandler) -> None:
        attempt = 0
        while True:
            address = self._next_address(attempt)
            retry_after = 0.0
            try:
                established = await self._session(address, handler)
            except grpc.aio.AioRpcError as exc:
                established = False
                retry_after = retry_after_s(exc)
                self._note_refusal(address, exc)
            except TimeoutError:
                established = False
                log.warning("coordinator %s sent no Welcome within %.0fs", address, self._welcome_timeout_s)
            except Exception:  # noqa: BLE001 - a bug here must not leave the agent without a session for good
                established = False
                log.exception("session with %s failed unexpectedly; reconnecting", address)
            finally:
                if self.connected.is_set():
                    self.connected.clear()
                    handler.on_connected(False)
            if established:
                attempt = 0
            else:
                attempt += 1
            await self._clock.asleep(backoff_delay(attempt, self._rng, self._backoff_cap_s, retry_after))

    def _note_refusal(self, address: str, exc: grpc.aio.AioRpcError) -> None:
        metadata = dict(exc.trailing_metadata() or ())
        if LEADER_ADDRESS_METADATA in metadata:
            self.contact.heard()  # a coordinator answered (a standby, or one mid-election): not cut off
        leader = metadata.get(LEADER_ADDRESS_METADATA)
        if leader and leader != address and self._credentials is not None and leader not in self._addresses:
            # Over TLS the agent dials only coordinators it was configured with, whoever names another.
            log.warning("%s names the leader at %s, which is not among the configured coordinators (%s); "
                        "ignoring the hint", address, leader[:100], ", ".join(self._addresses))
        elif leader and leader != address:
            self._leader_hint = leader
            log.info("%s is a standby; the leader is at %s", address, leader)
        else:
            hint = unnamed_address_hint(address, exc.details() or "")
            log.warning("session with %s failed: %s %s%s", address, exc.code().name, exc.details(),
                        f"; {hint}" if hint else "")

    async def _channel_to(self, address: str) -> grpc.aio.Channel:
        """The channel of the last attempt when the coordinator at `address` deferred it (RESOURCE_EXHAUSTED:
        its connection works, the coordinator only asked the agent to come back later), else a new one.
        In a connect burst most Hellos are deferred: each return then costs the coordinator a stream, not
        a connection (and, with TLS, a handshake). Every other failure gets a new channel, so a link cut
        or a coordinator gone is never retried on a connection that may be dead."""
        kept, self._kept = self._kept, None
        if kept is not None:
            if kept[0] == address:
                return kept[1]
            await kept[1].close()
        if self._credentials is None:
            return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(address, self._credentials, options=CHANNEL_OPTIONS)

    async def _session(self, address: str, handler: SessionHandler) -> bool:
        """One session; returns True when it was established before it ended."""
        channel = await self._channel_to(address)
        deferred = False
        try:
            return await self._session_on(channel, address, handler)
        except grpc.aio.AioRpcError as exc:
            deferred = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            raise
        finally:
            if deferred:
                self._kept = (address, channel)
            else:
                await channel.close()

    async def _session_on(self, channel: grpc.aio.Channel, address: str, handler: SessionHandler) -> bool:
        """Hello, Welcome, then heartbeats, reports and commands on `channel` until the session ends."""
        call = pb_grpc.CoordinatorStub(channel).Session()
        hello = pb.Hello()
        hello.CopyFrom(self._hello)
        hello.resume_token = self._identity.load_token(hello.node_name)
        hello.next_welcome_wait_s = self._welcome_timeout_s
        await _write_first(call, pb.AgentMessage(hello=hello))
        # The whole of its patience, from the first Hello: a Hello with no answer yet has most often
        # waited in the coordinator's gRPC queue (in a connect burst of 10,000 agents, up to 25 s on
        # two cores), and one given up goes to the back of that queue again and costs the coordinator
        # a call it takes for nothing. A coordinator that is gone or frozen ends the call sooner:
        # keepalive (CHANNEL_OPTIONS); a standby answers at once, naming the leader.
        async with asyncio.timeout(self._welcome_timeout_s):
            first = await call.read()
        if first is grpc.aio.EOF:
            code = await call.code()
            log.warning("coordinator %s closed the session before Welcome (%s)", address, code.name)
            return False
        if first.WhichOneof("body") != "welcome":
            log.warning("coordinator %s did not start with Welcome; reconnecting", address)
            return False
        unusable = _unusable_terms(first.welcome)
        if unusable is not None:
            log.warning("coordinator %s sent a Welcome whose %s the agent cannot keep to; reconnecting", address,
                        unusable)
            return False
        self.welcome = first.welcome
        self.contact.welcomed(FenceTerms(first.welcome.heartbeat_timeout_s, first.welcome.stop_grace_s)
                              if first.welcome.heartbeat_timeout_s > 0 else None)
        self.interval_s = first.welcome.heartbeat_interval_s
        self._backoff_cap_s = max(BACKOFF_BASE_S, min(BACKOFF_CAP_S, self.interval_s))
        self._identity.save_token(hello.node_name, first.welcome.resume_token)
        log.info("registered as %s with coordinator %s at %s", hello.node_name,
                 first.welcome.coordinator_id, address)
        self.connected.set()
        handler.on_connected(True)
        # What is queued by now (reports from while no session was open, and those the handler sends
        # again for a leader that may not have them) goes out before the first heartbeat: a leader that
        # reads a heartbeat showing the generation stopped has its newest commit by then.
        try:
            await self._write_queued(call)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            log.warning("session with %s broke before its first heartbeat: %s; reconnecting", address, exc)
            call.cancel()
            return True
        # grpc.aio allows one write in flight per stream: heartbeats and reports take turns.
        write_lock = asyncio.Lock()
        tasks = [
            asyncio.create_task(self._heartbeats(call, write_lock, handler)),
            asyncio.create_task(self._forward_outbox(call, write_lock)),
            asyncio.create_task(self._read_commands(call, handler)),
            asyncio.create_task(self._until_silent()),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                error = task.exception()
                if isinstance(error, asyncio.InvalidStateError):
                    # A write into an RPC that has just ended (its status arrives on the reader).
                    log.warning("session with %s broke: %s", address, error)
                elif error is not None and not isinstance(error, grpc.aio.AioRpcError):
                    raise error
                elif error is not None:
                    log.warning("session with %s broke: %s %s", address, error.code().name, error.details())
        finally:
            for task in tasks:
                task.cancel()
            call.cancel()
        log.warning("session with %s ended; reconnecting", address)
        return True

    async def _heartbeats(self, call, write_lock: asyncio.Lock, handler: SessionHandler) -> None:
        sequence = 0
        while True:
            sequence += 1
            async with write_lock:
                # Built once it is this heartbeat's turn, not before: built first, it could wait behind the
                # reports of a generation launched meanwhile and then name the generation before.
                body = handler.heartbeat_body()
                body.sequence = sequence
                # What building it queued goes first (held-back progress): the coordinator believes no
                # snapshot the heartbeat names beyond the steps reported.
                await self._write_queued(call)
                await call.write(pb.AgentMessage(heartbeat=body))
            await self._clock.asleep(self.interval_s)

    async def _until_silent(self) -> None:
        """Returns once heartbeats have gone unacknowledged for `redial_after_s` (a cut link breaks no
        connection, and a write into it may block): the session is then given up and dialled again."""
        while True:
            terms = self.contact.terms
            if terms is not None and self.contact.silent_for() > redial_after_s(self.interval_s, terms.timeout_s):
                break
            await self._clock.asleep(self.interval_s / 2)
        log.warning("no answer from the coordinator for %.1fs; reconnecting", self.contact.silent_for())

    def _follow_pace(self, ack: pb.HeartbeatAck) -> None:
        """The leader names the pace in every ack; a sane one is taken (an older leader names none)."""
        terms = self.contact.terms
        if not _sane_pace(ack.interval_s, ack.timeout_s):
            return
        if ack.interval_s != self.interval_s:
            log.info("the coordinator asks for a heartbeat every %.2fs (fencing after %.1fs unanswered)",
                     ack.interval_s, ack.timeout_s)
            self.interval_s = ack.interval_s
        if terms is not None and terms.timeout_s != ack.timeout_s:
            self.contact.terms = FenceTerms(ack.timeout_s, terms.stop_grace_s)

    async def _forward_outbox(self, call, write_lock: asyncio.Lock) -> None:
        while True:
            await self._queued.wait()
            async with write_lock:
                await self._write_queued(call)
                self._queued.clear()

    async def _read_commands(self, call, handler: SessionHandler) -> None:
        while True:
            message = await call.read()
            if message is grpc.aio.EOF:
                return
            if message.WhichOneof("body") == "heartbeat_ack":
                self.contact.heard()
                self._follow_pace(message.heartbeat_ack)
            elif (command := command_from(message)) is not None:
                handler.on_command(command)
            else:
                log.warning("ignoring unexpected %s from the coordinator", message.WhichOneof("body"))
