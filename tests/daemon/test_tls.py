"""The coordinator over real mutual TLS: a real grpc.aio server built as `trainerd start` builds it with
cluster.tls (certificates from `trainerd certs`), the real servicers in front of a real Coordinator (in-memory
store, fake clock), and real clients. What each certificate may call, that a node certificate speaks only
for its node, that handshakes without a certificate of the cluster's CA fail, and /metrics over HTTPS.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.cert_identity import names_host
from common.grpc_keepalive import HANDSHAKE_TIMEOUT_S
from common.tls_files import TlsFiles, TlsSettings, read_tls_files
from daemon.app import add_listener, grpc_server
from daemon.cli.trainerd_main import cli as trainerd_cli
from daemon.grpc_services import DEFAULT_MAX_SESSIONS, ControlService, CoordinatorService
from daemon.metrics_listener import start_metrics_server
from daemon.peer_auth import METHOD_ACCESS, STREAMS_PER_CERTIFICATE, Access
from proto import trainerd_pb2 as pb
from proto import trainerd_pb2_grpc as pb_grpc
from tests.daemon.job_sim import SimCluster, job_settings
from tests.harness import Processes
from tests.ports import free_port
from tests.waiting import wait_until

RPC_TIMEOUT_S = 5.0
READS = {"GetStatus": pb.StatusRequest(), "ListEvents": pb.EventsRequest(), "ListSkips": pb.SkipsRequest(),
         "ReadLog": pb.LogRequest(rank=0, max_bytes=100), "ListTokens": pb.ListTokensRequest()}
WRITES = {"Pause": pb.PauseRequest(), "Resume": pb.ResumeRequest(),
          "SetDrain": pb.DrainRequest(node="n1", drained=True),
          "AddSkip": pb.AddSkipRequest(start=1, end=2, reason="x"),
          "CreateToken": pb.CreateTokenRequest(ttl_s=60, uses=1), "DeleteToken": pb.DeleteTokenRequest(id="abc123"),
          "RevokeNode": pb.RevokeNodeRequest(node="n1")}


def trainerd(*argv: str) -> None:
    result = CliRunner().invoke(trainerd_cli, list(argv), catch_exceptions=False)
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cluster's CA and coordinator, nodes n1 and n2, operators alice (full) and bob (read-only)."""
    directory = tmp_path_factory.mktemp("pki")
    trainerd("certs", "init", "--dir", str(directory))
    trainerd("certs", "node", "n1", "--dir", str(directory))
    trainerd("certs", "node", "n2", "--dir", str(directory))
    trainerd("certs", "operator", "alice", "--dir", str(directory))
    trainerd("certs", "operator", "bob", "--read-only", "--dir", str(directory))
    return directory


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another cluster's: the same names, other keys."""
    directory = tmp_path_factory.mktemp("other-pki")
    trainerd("certs", "init", "--dir", str(directory))
    trainerd("certs", "operator", "alice", "--dir", str(directory))
    return directory


def tls_files(directory: Path, stem: str) -> TlsFiles:
    settings = TlsSettings(ca_file=str(directory / "ca.crt"), cert_file=str(directory / f"{stem}.crt"),
                           key_file=str(directory / f"{stem}.key"))
    return read_tls_files(settings, "test")


@dataclass(frozen=True)
class Served:
    address: str
    sim: SimCluster
    service: CoordinatorService


@asynccontextmanager
async def served_coordinator(pki: Path, tls: bool = True,
                             max_sessions: int = DEFAULT_MAX_SESSIONS) -> AsyncIterator[Served]:
    """A leading coordinator served as trainerd serves it: over TLS with peer checks, or plain text."""
    sim = SimCluster(job_settings())
    await sim.lead()
    server = grpc_server(check_peers=tls, max_sessions=max_sessions)
    port = add_listener(server, "127.0.0.1:0", tls_files(pki, "coordinator") if tls else None)
    service = CoordinatorService(sim.coordinator, max_sessions)
    pb_grpc.add_CoordinatorServicer_to_server(service, server)
    pb_grpc.add_ControlServicer_to_server(ControlService(sim.coordinator), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    await server.start()
    try:
        yield Served(f"127.0.0.1:{port}", sim, service)
    finally:
        await server.stop(None)


@asynccontextmanager
async def tls_coordinator(pki: Path, tls: bool = True) -> AsyncIterator[tuple[str, SimCluster]]:
    async with served_coordinator(pki, tls) as served:
        yield served.address, served.sim


@dataclass(frozen=True)
class Answer:
    code: grpc.StatusCode
    details: str


def channel(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(address, credentials)


async def control(address: str, credentials: grpc.ChannelCredentials | None, method: str, request) -> Answer:
    async with channel(address, credentials) as ch:
        try:
            reply = await getattr(pb_grpc.ControlStub(ch), method)(request, timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            return Answer(exc.code(), exc.details() or "")
        return Answer(grpc.StatusCode.OK, getattr(reply, "message", ""))


async def session(address: str, credentials: grpc.ChannelCredentials | None, node_name: str) -> Answer:
    """Open a Session as `node_name`: OK 'welcome', or the refusal."""
    async with channel(address, credentials) as ch:
        call = pb_grpc.CoordinatorStub(ch).Session(timeout=RPC_TIMEOUT_S)
        try:
            await call.write(pb.AgentMessage(hello=pb.Hello(
                node_name=node_name, host="10.0.0.1", devices=[pb.Device(device_id=0, kind="cpu")])))
            reply = await call.read()
        except grpc.aio.AioRpcError as exc:
            return Answer(exc.code(), exc.details() or "")
        finally:
            call.cancel()
        return Answer(grpc.StatusCode.OK, reply.WhichOneof("body"))


async def session_written_late(address: str, credentials: grpc.ChannelCredentials, delay_s: float) -> Answer:
    """Open a Session and write its Hello only after `delay_s`, as an agent on a busy host may."""
    async with channel(address, credentials) as ch:
        call = pb_grpc.CoordinatorStub(ch).Session(timeout=RPC_TIMEOUT_S)
        try:
            await asyncio.sleep(delay_s)
            await call.write(pb.AgentMessage(hello=pb.Hello(node_name="n1", host="10.0.0.1")))
            await call.read()
        except grpc.aio.AioRpcError as exc:
            return Answer(exc.code(), exc.details() or "")
        finally:
            call.cancel()
        return Answer(grpc.StatusCode.OK, "")


async def health_check(address: str, credentials: grpc.ChannelCredentials) -> Answer:
    async with channel(address, credentials) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S)
    return Answer(grpc.StatusCode.OK, health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 90))


def test_every_method_of_the_coordinator_is_in_the_access_table() -> None:
    """A new RPC is refused to every certificate until the table says who may call it. (SnapshotPeer is
    served by agents, to node certificates only: agent/snapshots/peer_service.py; Bootstrap on the join listener alone,
    to clients without certificates: daemon/app.py bootstrap_server.)"""
    methods = {f"/{service.full_name}/{method.name}" for service in pb.DESCRIPTOR.services_by_name.values()
               if service.name not in ("SnapshotPeer", "Bootstrap") for method in service.methods}
    assert methods - set(METHOD_ACCESS) == set()
    assert {name for name, access in METHOD_ACCESS.items() if access is Access.READ} == {
        f"/trainerd.v1.Control/{name}" for name in READS}
    assert {name for name, access in METHOD_ACCESS.items() if access is Access.WRITE} == {
        f"/trainerd.v1.Control/{name}" for name in WRITES}


def test_what_each_certificate_may_call(pki: Path) -> None:
    """A full operator gets what a plain-text client gets; a read-only operator the same for reads and a refusal
    naming its role for changes; a node certificate no Control method at all; an operator no Session."""
    async def answers(tls: bool, stem: str | None) -> dict[str, Answer]:
        credentials = tls_files(pki, stem).channel_credentials() if stem else None
        async with tls_coordinator(pki, tls) as (address, _):
            found = {method: await control(address, credentials, method, request)
                     for method, request in {**READS, **WRITES}.items()}
            found["Session"] = await session(address, credentials, "n1")
            return found

    plain = run(answers(False, None))
    alice, bob, n1 = run(answers(True, "alice")), run(answers(True, "bob")), run(answers(True, "n1"))

    assert plain["GetStatus"].code is grpc.StatusCode.OK and plain["Session"] == Answer(grpc.StatusCode.OK, "welcome")
    denied = grpc.StatusCode.PERMISSION_DENIED
    assert {method: answer for method, answer in alice.items() if method != "Session"} == {
        method: answer for method, answer in plain.items() if method != "Session"}
    assert alice["Session"] == Answer(denied, "the certificate of operator alice cannot call Session: it needs an "
                                              "agent's node certificate")
    for method in READS:
        assert bob[method].code is plain[method].code is not denied, method
    for method in WRITES:
        assert bob[method] == Answer(denied, f"operator bob is read-only: {method} needs a full (not read-only) "
                                             f"operator certificate"), method
    for method in READS:
        assert n1[method] == Answer(denied, f"the certificate of node n1 cannot call {method}: it needs an "
                                            f"operator certificate"), method
    for method in WRITES:
        assert n1[method] == Answer(denied, f"the certificate of node n1 cannot call {method}: it needs a full "
                                            f"(not read-only) operator certificate"), method
    assert n1["Session"] == Answer(grpc.StatusCode.OK, "welcome")


def test_a_node_certificate_speaks_only_for_its_node(pki: Path) -> None:
    async def scenario() -> tuple[Answer, list[str], Answer]:
        async with tls_coordinator(pki) as (address, _):
            credentials = tls_files(pki, "n1").channel_credentials()
            impostor = await session(address, credentials, "n2")
            async with channel(address, tls_files(pki, "bob").channel_credentials()) as ch:
                reply = await pb_grpc.ControlStub(ch).GetStatus(pb.StatusRequest(), timeout=RPC_TIMEOUT_S)
            return impostor, [node.name for node in reply.nodes], await session(address, credentials, "n1")

    impostor, nodes, own = run(scenario())
    assert impostor == Answer(grpc.StatusCode.PERMISSION_DENIED,
                              "the certificate of node n1 cannot open a session as node n2")
    assert nodes == []  # the refused Hello never reached the coordinator
    assert own == Answer(grpc.StatusCode.OK, "welcome")


def test_a_refused_session_says_why_even_to_an_agent_that_writes_its_hello_late(pki: Path) -> None:
    """The refusal waits for the Hello: had the stream ended first, the agent's write would fail with
    INTERNAL "Internal error from Core" (grpc/grpc#36066), which names no certificate."""
    async def scenario() -> Answer:
        async with tls_coordinator(pki) as (address, _):
            return await session_written_late(address, tls_files(pki, "alice").channel_credentials(), 0.5)

    assert run(scenario()) == Answer(grpc.StatusCode.PERMISSION_DENIED, "the certificate of operator alice cannot "
                                     "call Session: it needs an agent's node certificate")


def test_any_certificate_of_the_cluster_may_ask_for_health(pki: Path) -> None:
    async def scenario() -> list[Answer]:
        async with tls_coordinator(pki) as (address, _):
            return [await health_check(address, tls_files(pki, stem).channel_credentials())
                    for stem in ("n1", "bob")]

    assert run(scenario()) == [Answer(grpc.StatusCode.OK, "SERVING")] * 2


def test_handshakes_without_a_certificate_of_the_cluster_ca_fail_before_any_servicer(
    pki: Path, other_pki: Path
) -> None:
    clients = {
        "plain text": None,
        "no client certificate": grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes()),
        # Built from the files as they are: read_tls_files refuses such a pair before it is ever sent.
        "a certificate of another CA": grpc.ssl_channel_credentials(
            (pki / "ca.crt").read_bytes(), (other_pki / "alice.key").read_bytes(),
            (other_pki / "alice.crt").read_bytes()),
        "trusting another CA": tls_files(other_pki, "alice").channel_credentials(),
    }

    async def scenario() -> tuple[dict[str, grpc.StatusCode], int]:
        async with tls_coordinator(pki) as (address, sim):
            codes = {}
            for case, credentials in clients.items():
                codes[f"{case}: GetStatus"] = (await control(address, credentials, "GetStatus",
                                                             pb.StatusRequest())).code
                codes[f"{case}: Session"] = (await session(address, credentials, "n1")).code
            return codes, sim.coordinator.session_count

    codes, sessions = run(scenario())
    assert codes == {case: grpc.StatusCode.UNAVAILABLE for case in codes}
    assert sessions == 0


async def answer_of(call) -> Answer:
    """How a stream the test opened ended."""
    try:
        await call.read()
    except grpc.aio.AioRpcError as exc:
        return Answer(exc.code(), exc.details() or "")
    return Answer(grpc.StatusCode.OK, "")


def test_one_node_certificate_holding_idle_streams_does_not_lock_another_node_out(pki: Path, caplog) -> None:
    """Issue 47: streams that never send a Hello count toward max_sessions (until their Hello times out), and
    while one node held them all, a restarted real agent was refused RESOURCE_EXHAUSTED, went LOST, and the
    job WAITING. One certificate now holds at most its share; the refusal of the rest says so."""
    max_sessions = STREAMS_PER_CERTIFICATE + 2

    async def scenario() -> tuple[list[Answer], Answer]:
        async with served_coordinator(pki, max_sessions=max_sessions) as served:
            async with channel(served.address, tls_files(pki, "n1").channel_credentials()) as ch:
                idle = [pb_grpc.CoordinatorStub(ch).Session(timeout=30) for _ in range(max_sessions)]
                ended = [asyncio.create_task(answer_of(call)) for call in idle]

                def all_counted() -> bool:  # every stream has reached the servicer or been refused before it
                    return served.service._open_streams + sum(task.done() for task in ended) >= max_sessions
                while not all_counted():
                    await asyncio.sleep(0.05)
                newcomer = await session(served.address, tls_files(pki, "n2").channel_credentials(), "n2")
                for call in idle:
                    call.cancel()
                return [task.result() for task in ended if task.done()], newcomer

    refused, newcomer = run(scenario())
    assert newcomer == Answer(grpc.StatusCode.OK, "welcome")
    assert refused == [Answer(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"node n1 already has {STREAMS_PER_CERTIFICATE} calls open here, the most one "
                              f"certificate may; retry when one has ended")] * (max_sessions - STREAMS_PER_CERTIFICATE)
    warned = [r.getMessage() for r in caplog.records if r.name == "daemon.peer_auth"]
    assert warned == [f"refused a Session stream: node n1 already has {STREAMS_PER_CERTIFICATE} calls open here, "
                      f"the most one certificate may; retry when one has ended"]  # once a minute at most


def test_health_watch_streams_count_toward_a_certificates_share(pki: Path) -> None:
    """Issue 47: Health/Watch streams were not counted at all: one certificate could open any number."""
    async def scenario() -> tuple[Answer, Answer, Answer]:
        async with served_coordinator(pki) as served:
            credentials = tls_files(pki, "n1").channel_credentials()
            async with channel(served.address, credentials) as ch:
                health_stub = health_pb2_grpc.HealthStub(ch)
                watches = [health_stub.Watch(health_pb2.HealthCheckRequest(), timeout=30)
                           for _ in range(STREAMS_PER_CERTIFICATE)]
                for watch in watches:  # each is admitted: its first answer came
                    await watch.read()
                one_more = health_stub.Watch(health_pb2.HealthCheckRequest(), timeout=30)
                refused_watch = await answer_of(one_more)
                refused_session = await session(served.address, credentials, "n1")
                watches[0].cancel()  # its place is free once the coordinator has seen it end
                while (welcomed := await session(served.address, credentials, "n1")).code is \
                        grpc.StatusCode.RESOURCE_EXHAUSTED:
                    await asyncio.sleep(0.05)
                for watch in watches:
                    watch.cancel()
                return refused_watch, refused_session, welcomed

    refused_watch, refused_session, welcomed = run(scenario())
    full = Answer(grpc.StatusCode.RESOURCE_EXHAUSTED, f"node n1 already has {STREAMS_PER_CERTIFICATE} calls open "
                                                      f"here, the most one certificate may; retry when one has ended")
    assert refused_watch == full and refused_session == full
    assert welcomed == Answer(grpc.StatusCode.OK, "welcome")


def test_a_connection_that_never_completes_its_handshake_is_closed(pki: Path) -> None:
    """gRPC waits 120 s for a handshake by default; the coordinator waits HANDSHAKE_TIMEOUT_S (the test's
    hard limit is far below gRPC's default and far above ours)."""
    async def scenario() -> bytes:
        async with tls_coordinator(pki) as (address, _):
            host, port = address.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                return await asyncio.wait_for(reader.read(1), 6 * HANDSHAKE_TIMEOUT_S)
            finally:
                writer.close()

    assert run(scenario()) == b""


def fetch_metrics(port: int, context: ssl.SSLContext) -> str:
    with urllib.request.urlopen(f"https://localhost:{port}/metrics", context=context, timeout=5) as reply:
        return reply.read().decode()


def test_metrics_over_https_need_a_client_certificate_of_the_cluster(pki: Path, other_pki: Path) -> None:
    port = free_port()
    tls = TlsSettings(ca_file=str(pki / "ca.crt"), cert_file=str(pki / "coordinator.crt"),
                      key_file=str(pki / "coordinator.key"))
    server = start_metrics_server(f"127.0.0.1:{port}", tls)

    def client(directory: Path | None = None, stem: str = "") -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        if directory is not None:
            context.load_cert_chain(directory / f"{stem}.crt", directory / f"{stem}.key")
        return context

    try:
        assert "trainerd_" in fetch_metrics(port, client(pki, "bob"))  # a read-only operator may scrape
        for refused in (client(), client(other_pki, "alice")):
            with pytest.raises(OSError):  # the handshake's alert, or the connection it closes
                fetch_metrics(port, refused)
    finally:
        server.shutdown()
        server.server_close()


def test_an_idle_connection_to_metrics_stalls_no_scrape_and_is_closed_after_the_timeout(pki: Path) -> None:
    """Issue 47: prometheus_client's server did the TLS handshake in its accept loop, so one TCP connection
    that never sent a byte stalled every scrape after it for as long as it stayed open."""
    port = free_port()
    tls = TlsSettings(ca_file=str(pki / "ca.crt"), cert_file=str(pki / "coordinator.crt"),
                      key_file=str(pki / "coordinator.key"))
    server = start_metrics_server(f"127.0.0.1:{port}", tls, timeout_s=1.0)
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    context.load_cert_chain(pki / "bob.crt", pki / "bob.key")
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as idle:
            assert "trainerd_" in fetch_metrics(port, context)  # 5 s at most, while the idle one is open
            assert idle.recv(1) == b""  # its handshake gave up, and the server closed it
            assert "trainerd_" in fetch_metrics(port, context)
    finally:
        server.shutdown()
        server.server_close()


def test_whether_a_certificate_names_the_address_a_client_dials(pki: Path) -> None:
    certificate = (pki / "coordinator.crt").read_bytes()  # `trainerd certs init`: localhost and 127.0.0.1
    assert names_host(certificate, "127.0.0.1") and names_host(certificate, "LocalHost.")
    assert not names_host(certificate, "10.0.0.9") and not names_host(certificate, "head.example.org")
    assert not names_host(b"not a certificate", "127.0.0.1")


def test_trainerd_says_at_start_that_its_certificate_does_not_name_the_address_it_advertises(
        pki: Path, tmp_path: Path) -> None:
    """A standby hands that address to agents as the leader's, and they refuse the certificate there."""
    listen, client, peer = free_port(), free_port(), free_port()
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        f"cluster:\n  coordinator: {{listen: '127.0.0.1:{listen}', advertise: '10.0.0.9:{listen}'}}\n"
        f"  etcd: {{client_listen: '127.0.0.1:{client}', peer_listen: '127.0.0.1:{peer}',"
        f" data_dir: {tmp_path}/etcd}}\n"
        f"  tls: {{ca_file: {pki}/ca.crt, cert_file: {pki}/coordinator.crt, key_file: {pki}/coordinator.key}}\n")
    procs = Processes(tmp_path)
    try:
        trainerd = procs.trainerd("trainerd", cluster)
        wait_until(lambda: "is now the leader" in trainerd.log(), timeout=60, what="trainerd to lead",
                   on_timeout=procs.logs)
        warnings = [line for line in trainerd.log().splitlines() if "does not name" in line]
        assert len(warnings) == 1 and warnings[0].endswith(
            "does not name 10.0.0.9, the address it advertises: agents sent there refuse it; reissue it with "
            "`trainerd certs coordinator --dir DIR --host 10.0.0.9 --force` (and every other name agents dial)")
    finally:
        procs.cleanup()
