"""The agents' snapshot transport (agent/snapshots/peer_service.py, peer_client.py, peer_copier.py): real gRPC servers
on loopback, real mutual TLS with certificates of daemon.certs, real snapshot files on tmp_path."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID

from agent.commands import PeerAgent, Stop
from agent.config import AgentConfig
from agent.main import Agent
from agent.snapshots.memory_snapshots import (
    HostScope,
    MemorySnapshotDir,
    Snapshot,
    SnapshotAssemblyError,
    step_dir_name,
)
from agent.snapshots.peer_client import NotServedYet, PeerClient
from agent.snapshots.peer_copier import PeerCopier
from agent.snapshots.peer_service import MAX_LIST_WAIT_S, MAX_QUEUED_RPCS, PEER_CALLS_PER_CERTIFICATE, PeerServer
from agent.snapshots.snapshot_reports import read_report
from agent.systemd import SystemdNotifier
from agent.thread_priority import BACKGROUND_NICENESS
from common.cert_identity import serial_of
from common.tls_files import TlsFiles
from daemon.certs import Issued, make_ca, make_node_certificate, make_operator_certificate
from proto import trainerd_pb2 as pb
from proto import trainerd_pb2_grpc as pb_grpc
from tests.agent.snapshot_files import TENSORS, host_snapshot
from tests.agent.supervisor_fakes import Host, launch, run
from tests.daemon.test_certs import hand_made
from tests.ports import free_port
from tests.waiting import wait_until
from trainer.checkpoint import load_checkpoint

JOB = "job"
SERVER_NODE = "gpu_07.rack-2"  # '_' and '.': the TLS host check must take every valid node name


def tls_of(ca: Issued, leaf: Issued) -> TlsFiles:
    return TlsFiles(ca.certificate_pem(), leaf.certificate_pem(), leaf.key_pem())


@pytest.fixture(scope="module")
def ca() -> Issued:
    return make_ca()


def holder_memory(root: Path, rank: int, steps: tuple[int, ...] = (50,), world_size: int = 2) -> MemorySnapshotDir:
    """A host running `rank` of `world_size`, its snapshots of `steps` pinned."""
    memory = MemorySnapshotDir(root / f"host{rank}")
    job_dir = memory.prepare(JOB, None, HostScope((rank,), world_size, 3))
    for step in steps:
        host_snapshot(job_dir, step, (rank,), world_size=world_size)
        assert memory.newest(JOB) == Snapshot(step, 8 * step)
    return memory


@pytest.fixture
def serve() -> Iterator[Callable[..., int]]:
    """Start a PeerServer; every one started is stopped after the test."""
    servers: list[PeerServer] = []

    def start(memory: MemorySnapshotDir, tls: TlsFiles | None, host: str = "127.0.0.1", port: int = 0,
              peers: tuple[str, ...] = ("n0",)) -> int:
        """`peers`: the nodes of the generation it serves."""
        server = PeerServer(memory, host, tls, port)
        servers.append(server)
        server.serve_generation(3, peers)
        return server.start()

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def client_of() -> Iterator[Callable[[TlsFiles | None], PeerClient]]:
    clients: list[PeerClient] = []

    def make(tls: TlsFiles | None) -> PeerClient:
        clients.append(PeerClient(tls))
        return clients[-1]

    yield make
    for client in clients:
        client.close()


def test_a_rank_fetched_over_tls_is_whole_and_assembles(tmp_path: Path, ca: Issued, serve, client_of) -> None:
    holder = holder_memory(tmp_path, 1)
    port = serve(holder, tls_of(ca, make_node_certificate(ca, SERVER_NODE)))
    client = client_of(tls_of(ca, make_node_certificate(ca, "n0")))
    peer = PeerAgent(node=SERVER_NODE, address=f"127.0.0.1:{port}")
    listed = client.list_snapshots(peer, JOB, 10)
    assert [(s.step, list(s.ranks), s.world_size, s.generation) for s in listed] == [(50, [1], 2, 3)]
    into = tmp_path / "fetched"
    into.mkdir()
    client.fetch_rank(peer, JOB, 50, 1, into, 10)
    assert read_report(into, 1, 50) is not None
    assert sorted(p.name for p in into.iterdir()) == ["rank_1.done.json", "rank_1.safetensors"]

    local = holder_memory(tmp_path, 0)
    step_dir = local.assemble(JOB, 50, 2, lambda rank, d: client.fetch_rank(peer, JOB, 50, rank, d, 10))
    tensors, manifest = load_checkpoint(step_dir, 0, 2)
    assert manifest.step == 50 and all(np.array_equal(tensors[n], t) for n, t in TENSORS.items())


def test_the_server_admits_only_node_certificates_of_its_ca(tmp_path: Path, ca: Issued, serve, client_of) -> None:
    port = serve(holder_memory(tmp_path, 1), tls_of(ca, make_node_certificate(ca, SERVER_NODE)))
    peer = PeerAgent(node=SERVER_NODE, address=f"127.0.0.1:{port}")
    operator = client_of(tls_of(ca, make_operator_certificate(ca, "alice", False)))
    with pytest.raises(SnapshotAssemblyError, match="PERMISSION_DENIED: only agents") as refused:
        operator.list_snapshots(peer, JOB, 10)
    assert "\n" not in str(refused.value)
    with pytest.raises(SnapshotAssemblyError, match="PERMISSION_DENIED"):
        operator.fetch_rank(peer, JOB, 50, 1, tmp_path, 10)
    other_ca = make_ca()
    impostor = make_node_certificate(other_ca, "n0")  # the same name, another CA
    stranger = client_of(TlsFiles(ca.certificate_pem(), impostor.certificate_pem(), impostor.key_pem()))
    with pytest.raises(SnapshotAssemblyError, match="UNAVAILABLE"):
        stranger.list_snapshots(peer, JOB, 10)


def test_the_server_refuses_revoked_certificates_from_the_next_call_on(tmp_path: Path, ca: Issued, client_of) -> None:
    server = PeerServer(holder_memory(tmp_path, 1), "127.0.0.1", tls_of(ca, make_node_certificate(ca, SERVER_NODE)))
    port = server.start()
    server.serve_generation(1, ("n0", "n2", SERVER_NODE))
    try:
        peer = PeerAgent(node=SERVER_NODE, address=f"127.0.0.1:{port}")
        revoked_certificate = make_node_certificate(ca, "n0")
        revoked, other = client_of(tls_of(ca, revoked_certificate)), client_of(tls_of(ca, make_node_certificate(ca, "n2")))
        assert revoked.list_snapshots(peer, JOB, 10)
        server.refuse(frozenset({serial_of(revoked_certificate.certificate_pem())}))
        with pytest.raises(SnapshotAssemblyError, match="PERMISSION_DENIED.*node n0 is revoked"):
            revoked.list_snapshots(peer, JOB, 10)
        assert other.list_snapshots(peer, JOB, 10)
    finally:
        server.stop()


def test_only_the_nodes_of_the_generation_launched_last_are_served(tmp_path: Path, ca: Issued, client_of) -> None:
    """Issue 47: SnapshotPeer served any node certificate of the cluster, for any job."""
    server = PeerServer(holder_memory(tmp_path, 1), "127.0.0.1", tls_of(ca, make_node_certificate(ca, SERVER_NODE)))
    peer = PeerAgent(node=SERVER_NODE, address=f"127.0.0.1:{server.start()}")
    n0, n9 = (client_of(tls_of(ca, make_node_certificate(ca, name))) for name in ("n0", "n9"))
    try:
        with pytest.raises(SnapshotAssemblyError, match="FAILED_PRECONDITION: this agent has not been launched since "
                                                        "it started, so node n0 is of no generation of it"):
            n0.list_snapshots(peer, JOB, 10)
        server.serve_generation(3, ("n0", SERVER_NODE))
        assert n0.list_snapshots(peer, JOB, 10)
        with pytest.raises(SnapshotAssemblyError, match="FAILED_PRECONDITION: node n9 is not of generation 3, the one "
                                                        "this agent was launched in last"):
            n9.list_snapshots(peer, JOB, 10)
        with pytest.raises(NotServedYet, match="FAILED_PRECONDITION: node n9 is not of generation 3"):
            n9.fetch_rank(peer, JOB, 50, 1, tmp_path, 10)
        server.serve_generation(4, ("n9",))
        server.serve_generation(3, ("n0",))  # a Launch of the older generation, redelivered late
        assert n9.list_snapshots(peer, JOB, 10)
        with pytest.raises(SnapshotAssemblyError, match="FAILED_PRECONDITION: node n0 is not of generation 4"):
            n0.list_snapshots(peer, JOB, 10)
    finally:
        server.stop()


def test_the_agent_serves_the_nodes_its_launch_names(tmp_path: Path, ca: Issued, client_of) -> None:
    server = PeerServer(holder_memory(tmp_path, 1), "127.0.0.1", tls_of(ca, make_node_certificate(ca, SERVER_NODE)))
    peer = PeerAgent(node=SERVER_NODE, address=f"127.0.0.1:{server.start()}")
    n0 = client_of(tls_of(ca, make_node_certificate(ca, "n0")))

    async def scenario() -> list[pb.MemorySnapshot]:
        host = Host(tmp_path / "agent")
        agent = Agent(AgentConfig(coordinator=["127.0.0.1:1"], work_dir=str(tmp_path / "agent")),
                      link=None, supervisor=host.supervisor, notifier=SystemdNotifier(),  # type: ignore[arg-type]
                      clock=host.clock, launcher=host.launcher, peer_server=server)
        agent.on_command(launch(3, peer_nodes=("n0", SERVER_NODE)))
        listed = await asyncio.to_thread(n0.list_snapshots, peer, JOB, 10)
        await host.supervisor.stop(Stop(generation=3, grace_s=1.0))
        return listed

    try:
        with pytest.raises(SnapshotAssemblyError, match="FAILED_PRECONDITION"):  # no Launch yet
            n0.list_snapshots(peer, JOB, 10)
        assert [s.step for s in run(scenario())] == [50]
    finally:
        server.stop()


def test_one_nodes_stalled_fetches_do_not_lock_its_peers_out(tmp_path: Path, ca: Issued, serve, client_of) -> None:
    """Issue 47: 16 fetches that read nothing held every thread and queue place of the server, and the real
    peers were refused. A certificate now holds PEER_CALLS_PER_CERTIFICATE calls; more are refused at once."""
    memory = MemorySnapshotDir(tmp_path / "host1")
    job_dir = memory.prepare(JOB, None, HostScope((1,), 2, 3))
    host_snapshot(job_dir, 50, (1,), world_size=2, tensors={"big": np.zeros(16 << 20, dtype=np.float32)})
    assert memory.newest(JOB) == Snapshot(50, 400)
    port = serve(memory, tls_of(ca, make_node_certificate(ca, SERVER_NODE)), peers=("n0", "rogue"))
    peer = PeerAgent(node=SERVER_NODE, address=f"127.0.0.1:{port}")
    rogue_tls = tls_of(ca, make_node_certificate(ca, "rogue"))
    options = [("grpc.ssl_target_name_override", f"{SERVER_NODE}.node.trainerd")]
    with grpc.secure_channel(peer.address, rogue_tls.channel_credentials(), options=options) as channel:
        stub = pb_grpc.SnapshotPeerStub(channel)
        stalled = [stub.FetchFile(pb.PeerFetchRequest(job_name=JOB, step=50, rank=1, kind=pb.PEER_FILE_DATA),
                                  timeout=60) for _ in range(MAX_QUEUED_RPCS)]
        with ThreadPoolExecutor(MAX_QUEUED_RPCS) as pool:  # one chunk of each, then nothing more is read
            firsts = [pool.submit(next, call) for call in stalled]
            concurrent.futures.wait(firsts, timeout=20)  # each answered (or, before the quota, queued for 60 s)
            listed = client_of(tls_of(ca, make_node_certificate(ca, "n0"))).list_snapshots(peer, JOB, 10)
            for call in stalled:
                call.cancel()
        refusals = [(first.exception().code(), first.exception().details()) for first in firsts
                    if isinstance(first.exception(), grpc.RpcError)]
    assert [s.step for s in listed] == [50]
    assert refusals == [(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"node rogue already has {PEER_CALLS_PER_CERTIFICATE} calls open here, the most one "
                         f"certificate may; retry when one has ended")] * (MAX_QUEUED_RPCS - PEER_CALLS_PER_CERTIFICATE)


def test_a_client_refuses_a_server_presenting_another_nodes_certificate(tmp_path: Path, ca: Issued, serve,
                                                                         client_of) -> None:
    port = serve(holder_memory(tmp_path, 1), tls_of(ca, make_node_certificate(ca, "a")))
    client = client_of(tls_of(ca, make_node_certificate(ca, "n0")))
    with pytest.raises(SnapshotAssemblyError, match="of node b .*UNAVAILABLE"):
        client.list_snapshots(PeerAgent(node="b", address=f"127.0.0.1:{port}"), JOB, 10)
    assert client.list_snapshots(PeerAgent(node="a", address=f"127.0.0.1:{port}"), JOB, 10)


def test_a_node_certificate_made_before_serving_serves_nothing(tmp_path: Path, ca: Issued, serve, caplog) -> None:
    key = make_node_certificate(ca, "n1").key_pem()  # unused: the server refuses before it would be
    old = TlsFiles(ca.certificate_pem(), hand_made(ca, "n1", ["trainerd://node/n1"], ExtendedKeyUsageOID.CLIENT_AUTH),
                   key)
    with caplog.at_level(logging.WARNING, "agent.snapshots.peer_service"):
        assert serve(holder_memory(tmp_path, 1), old) == 0
    assert [r.message for r in caplog.records if r.message.startswith("serving no in-memory snapshots")]


def listening_addresses(port: int) -> list[str]:
    """The local addresses of the sockets listening on `port` (/proc/net/tcp and tcp6, hexadecimal)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:
                    found.append(address)
    return found


def test_without_tls_the_server_listens_on_loopback_only(tmp_path: Path, serve, client_of) -> None:
    port = serve(holder_memory(tmp_path, 1), None, host="0.0.0.0")
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, also as ::ffff:127.0.0.1
    assert listening_addresses(port) and set(listening_addresses(port)) <= loopback
    client = client_of(None)
    assert client.list_snapshots(PeerAgent(node="a", address=f"127.0.0.1:{port}"), JOB, 10)


def test_a_pinned_port_is_served_and_a_taken_one_says_why(tmp_path: Path, serve, client_of) -> None:
    """`snapshot_peer_port`, for a firewall between the hosts."""
    port = free_port()
    assert serve(holder_memory(tmp_path, 1), None, port=port) == port
    assert client_of(None).list_snapshots(PeerAgent(node="a", address=f"127.0.0.1:{port}"), JOB, 10)
    with pytest.raises(OSError, match=f"^the snapshot peer server cannot listen on 127.0.0.1:{port}: the address "
                                      "is in use"):
        serve(holder_memory(tmp_path / "other", 1), None, port=port)


def test_hostile_requests_are_invalid_arguments(tmp_path: Path, serve) -> None:
    port = serve(holder_memory(tmp_path, 1), None)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.SnapshotPeerStub(channel)
        for job in ("..", "../host0", "a/b", "", "x" * 256, "job\n"):
            with pytest.raises(grpc.RpcError) as refused:
                stub.ListSnapshots(pb.PeerListRequest(job_name=job), timeout=10)
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, job
        for job, step, rank, kind in ((JOB, -1, 1, pb.PEER_FILE_DATA), (JOB, 50, -1, pb.PEER_FILE_DATA),
                                      (JOB, 50, 1 << 20, pb.PEER_FILE_DATA), (JOB, 50, 1, pb.PEER_FILE_KIND_UNSPECIFIED),
                                      (JOB, 50, 1, 7), ("..", 50, 1, pb.PEER_FILE_DATA)):
            request = pb.PeerFetchRequest(job_name=job, step=step, rank=rank, kind=kind)
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.FetchFile(request, timeout=10))
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (job, step, rank, kind)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.FetchFile(pb.PeerFetchRequest(job_name=JOB, step=50, rank=0, kind=pb.PEER_FILE_DATA), timeout=10))
        assert refused.value.code() is grpc.StatusCode.NOT_FOUND  # not this host's rank


def test_a_list_waits_for_a_newer_snapshot_and_answers_as_soon_as_one_is_pinned(tmp_path: Path, serve) -> None:
    """The ring copier's long poll: nothing newer, the holder answers after the wait asked for (bounded by
    MAX_LIST_WAIT_S, whatever the request says); a snapshot written meanwhile is pinned and answered at once."""
    memory = holder_memory(tmp_path, 1, steps=(50,))
    port = serve(memory, None)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.SnapshotPeerStub(channel)

        def listed(newer_than_step: int, wait_s: float) -> tuple[list[int], float]:
            began = time.monotonic()
            reply = stub.ListSnapshots(pb.PeerListRequest(job_name=JOB, newer_than_step=newer_than_step,
                                                          wait_s=wait_s), timeout=30)
            return [held.step for held in reply.own], time.monotonic() - began

        assert listed(0, 0)[0] == [50]  # the defaults: at once
        steps, took = listed(-1, 10)  # something newer than -1 is there: at once
        assert steps == [50] and took < 1, took
        steps, took = listed(50, 0.6)  # nothing newer: after the wait
        assert steps == [50] and 0.6 <= took < 3, took
        for hostile in (float("nan"), float("-inf"), -5.0):
            steps, took = listed(50, hostile)
            assert steps == [50] and took < 1, (hostile, took)
        steps, took = listed(50, 1e9)  # the holder's bound, not the asker's
        assert steps == [50] and MAX_LIST_WAIT_S <= took < MAX_LIST_WAIT_S + 3, took

        writer = threading.Timer(0.5, host_snapshot, (memory.job_dir(JOB), 60, (1,)), {"world_size": 2})
        writer.start()
        try:
            steps, took = listed(50, 4)
        finally:
            writer.join()
        assert steps[0] == 60 and 0.5 <= took < 3, (steps, took)  # pinned by the list, without a heartbeat
        assert memory.newest(JOB) == Snapshot(60, 480)


def test_an_idle_copier_asks_its_source_a_few_times_not_ten_times_a_second(tmp_path: Path, memory_fs: Path,
                                                                           client_of) -> None:
    """With nothing new at the source, each ListSnapshots waits there for the next snapshot."""
    calls: list[float] = []

    class Counting(pb_grpc.SnapshotPeerServicer):
        def __init__(self, inner: pb_grpc.SnapshotPeerServicer) -> None:
            self._inner = inner

        def ListSnapshots(self, request, context):
            calls.append(time.monotonic())
            return self._inner.ListSnapshots(request, context)

        def FetchFile(self, request, context):
            return self._inner.FetchFile(request, context)

    source = holder_memory(tmp_path, 1, steps=(10,))
    local = holder_memory(memory_fs, 0, steps=())
    peer_server = PeerServer(source, "127.0.0.1", None)
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_SnapshotPeerServicer_to_server(Counting(peer_server._servicer), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    copier = PeerCopier(local, client_of(None), JOB, PeerAgent(node="host1", address=f"127.0.0.1:{port}"),
                        max_ranks=2)
    copier.start()
    try:
        wait_until(lambda: copies(local, "host1") == [step_dir_name(10)], 15, "the copy of step 10")
        idle_from = time.monotonic()
        time.sleep(3)
        asked = sum(1 for at in calls if at >= idle_from)
        assert asked <= 3, asked  # polled every 0.1 s, it asked 30 times
        host_snapshot(source.job_dir(JOB), 20, (1,), world_size=2)
        wait_until(lambda: step_dir_name(20) in copies(local, "host1"), 5, "the copy of step 20")
    finally:
        copier.stop()
        server.stop(None)


@pytest.mark.parametrize("where", ["file", "directory"])
def test_no_link_is_followed(tmp_path: Path, serve, client_of, where: str) -> None:
    holder = holder_memory(tmp_path, 1)
    pinned = holder.job_dir(JOB) / ".reported" / step_dir_name(50)
    elsewhere = tmp_path / "elsewhere"
    pinned.rename(elsewhere)
    if where == "file":  # the rank's file a link to a file of the same content
        pinned.mkdir()
        for child in elsewhere.iterdir():
            (pinned / child.name).symlink_to(child)
    else:  # the step directory a link to a directory holding the files
        pinned.symlink_to(elsewhere)
    port = serve(holder, None)
    into = tmp_path / "into"
    into.mkdir()
    with pytest.raises(SnapshotAssemblyError, match="NOT_FOUND"):
        client_of(None).fetch_rank(PeerAgent(node="a", address=f"127.0.0.1:{port}"), JOB, 50, 1, into, 10)
    assert list(into.iterdir()) == []


class LyingPeer(pb_grpc.SnapshotPeerServicer):
    """A peer whose report of rank 1 gives its data file `change` bytes more than it sends."""

    def __init__(self, step_dir: Path, change: int) -> None:
        self._step_dir, self._change = step_dir, change

    def FetchFile(self, request: pb.PeerFetchRequest, context: grpc.ServicerContext) -> Iterator[pb.PeerChunk]:
        if request.kind == pb.PEER_FILE_REPORT:
            body = json.loads((self._step_dir / "rank_1.done.json").read_text())
            body["file"]["size"] += self._change
            yield pb.PeerChunk(data=json.dumps(body).encode())
        else:
            yield pb.PeerChunk(data=(self._step_dir / "rank_1.safetensors").read_bytes())


@pytest.mark.parametrize(("change", "message"), [(-10, "sent more than"), (10, "ended after")])
def test_a_data_file_of_another_size_than_its_report_is_refused(tmp_path: Path, client_of, change: int,
                                                                 message: str) -> None:
    holder = holder_memory(tmp_path, 1)
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    pb_grpc.add_SnapshotPeerServicer_to_server(LyingPeer(holder.job_dir(JOB) / ".reported" / step_dir_name(50),
                                                         change), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        into = tmp_path / "into"
        into.mkdir()
        with pytest.raises(SnapshotAssemblyError, match=f"rank 1 of step 50 from node a .*{message}"):
            client_of(None).fetch_rank(PeerAgent(node="a", address=f"127.0.0.1:{port}"), JOB, 50, 1, into, 10)
        assert list(into.iterdir()) == []
    finally:
        server.stop(None)


def test_a_holder_serves_no_rank_whose_files_disagree_with_its_report(tmp_path: Path, serve, client_of) -> None:
    holder = holder_memory(tmp_path, 1)
    data = holder.job_dir(JOB) / ".reported" / step_dir_name(50) / "rank_1.safetensors"
    content = data.read_bytes()
    data.unlink()  # a hard link to the worker's: truncate a copy
    data.write_bytes(content[:-7])
    port = serve(holder, None)
    with pytest.raises(SnapshotAssemblyError, match="NOT_FOUND"):
        client_of(None).fetch_rank(PeerAgent(node="a", address=f"127.0.0.1:{port}"), JOB, 50, 1, tmp_path, 10)


def copies(memory: MemorySnapshotDir, node: str) -> list[str]:
    directory = memory.copies_root(JOB) / node
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


def test_the_copier_keeps_the_two_newest_snapshots_and_survives_its_source_going_down(
        tmp_path: Path, memory_fs: Path, serve, client_of, caplog) -> None:
    source = holder_memory(tmp_path, 1, steps=(10,))
    local = holder_memory(memory_fs, 0, steps=())
    server = PeerServer(source, "127.0.0.1", None)
    port = server.start()
    peer = PeerAgent(node="host1", address=f"127.0.0.1:{port}")
    (local.copies_root(JOB) / "host1" / (step_dir_name(5) + ".partial")).mkdir(parents=True)  # a crash's
    copier = PeerCopier(local, client_of(None), JOB, peer, max_ranks=2, interval_s=0.02)
    copier.start()
    try:
        wait_until(lambda: copies(local, "host1") == [step_dir_name(10)], 15, "the copy of step 10")
        # Both ends of the copy yield the cores to training: the copier's thread and the server's.
        priorities = {t.name: os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threading.enumerate()
                      if t.native_id is not None and t.name.startswith(("copier-", "peer-server"))}
        assert {name.split("_")[0] for name in priorities} == {"copier-host1", "peer-server"}, priorities
        assert set(priorities.values()) == {BACKGROUND_NICENESS}, priorities
        for step in (20, 30):
            host_snapshot(source.job_dir(JOB), step, (1,), world_size=2)
            assert source.newest(JOB) == Snapshot(step, 8 * step)
            name = step_dir_name(step)
            wait_until(lambda name=name: name in copies(local, "host1"), 15, f"the copy of step {step}")
        wait_until(lambda: copies(local, "host1") == [step_dir_name(20), step_dir_name(30)], 15, "two kept")
        assert [(s.step, list(s.ranks)) for s in local.held(JOB)] == [(30, [1]), (20, [1])]
        server.stop()
        with caplog.at_level(logging.DEBUG, "agent.snapshots.peer_copier"):
            wait_until(lambda: sum(r.message.startswith("cannot copy") for r in caplog.records) >= 3, 15,
                       "failed polls")
            host_snapshot(source.job_dir(JOB), 40, (1,), world_size=2)
            assert source.newest(JOB) == Snapshot(40, 320)
            assert serve(source, None, port=port) == port
            wait_until(lambda: copies(local, "host1") == [step_dir_name(30), step_dir_name(40)], 15, "step 40")
        levels = [r.levelno for r in caplog.records if r.message.startswith("cannot copy")]
        assert levels[0] == logging.WARNING and set(levels[1:]) == {logging.DEBUG}
        assert all("\n" not in r.message for r in caplog.records)
    finally:
        copier.stop()
        server.stop()


def test_a_copier_refuses_a_node_name_that_is_no_directory_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot name a directory"):
        PeerCopier(MemorySnapshotDir(tmp_path), PeerClient(None), JOB, PeerAgent(node="../x", address="h:1"),
                   max_ranks=2)


class HostilePeer(pb_grpc.SnapshotPeerServicer):
    """A peer listing `listed` and serving its own rank 1 of step 50 (`step_dir`); with `stall`, the data
    file's first chunk is followed by nothing until `release` is set."""

    def __init__(self, step_dir: Path, listed: pb.MemorySnapshot, stall: bool = False) -> None:
        self._step_dir, self._listed, self._stall = step_dir, listed, stall
        self.stalled, self.release = threading.Event(), threading.Event()

    def ListSnapshots(self, request: pb.PeerListRequest, context: grpc.ServicerContext) -> pb.PeerListReply:
        return pb.PeerListReply(own=[self._listed])

    def FetchFile(self, request: pb.PeerFetchRequest, context: grpc.ServicerContext) -> Iterator[pb.PeerChunk]:
        name = "rank_1.done.json" if request.kind == pb.PEER_FILE_REPORT else "rank_1.safetensors"
        data = (self._step_dir / name).read_bytes()
        if not self._stall or request.kind == pb.PEER_FILE_REPORT:
            yield pb.PeerChunk(data=data)
            return
        yield pb.PeerChunk(data=data[:10])
        self.stalled.set()
        self.release.wait(30)


@pytest.fixture
def hostile_peer(tmp_path: Path) -> Iterator[Callable[..., tuple[HostilePeer, PeerAgent]]]:
    servers: list[tuple[grpc.Server, HostilePeer]] = []

    def start(listed: pb.MemorySnapshot, stall: bool = False) -> tuple[HostilePeer, PeerAgent]:
        holder = holder_memory(tmp_path, 1)
        peer = HostilePeer(holder.job_dir(JOB) / ".reported" / step_dir_name(50), listed, stall)
        server = grpc.server(ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_SnapshotPeerServicer_to_server(peer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append((server, peer))
        return peer, PeerAgent(node="host1", address=f"127.0.0.1:{port}")

    yield start
    for server, peer in servers:
        peer.release.set()
        server.stop(None)


@pytest.mark.parametrize(("ranks", "world_size", "message"), [
    ([1, 1], 2, "names a rank twice"),
    ([1, 7], 2, "names ranks outside its world size 2"),
    ([-1], 2, "names ranks outside its world size 2"),
    (list(range(64)), 64, "names 64 ranks, more than the 2 of this generation's world"),
])
def test_a_copier_fetches_nothing_of_a_listing_no_node_could_hold(memory_fs: Path, hostile_peer, caplog,
                                                                  ranks: list[int], world_size: int,
                                                                  message: str) -> None:
    _, peer = hostile_peer(pb.MemorySnapshot(step=50, ranks=ranks, world_size=world_size, generation=3))
    local = holder_memory(memory_fs, 0, steps=())
    copier = PeerCopier(local, PeerClient(None), JOB, peer, max_ranks=2, interval_s=0.02)
    with caplog.at_level(logging.WARNING, "agent.snapshots.peer_copier"):
        copier.start()
        try:
            wait_until(lambda: any(message in r.message for r in caplog.records), 15, "the refusal")
        finally:
            copier.stop()
    assert copies(local, "host1") == []
    assert [r.message for r in caplog.records] == [
        f"cannot copy the snapshots of node host1 ({peer.address}): its snapshot of step 50 {message}; not copied"]


@pytest.fixture
def small_memory_fs(mount_tmpfs: Callable[[str, str], Path]) -> Path:
    """A 1 MiB tmpfs, as a host's shared memory nearly full of its own workers' snapshots would be."""
    return mount_tmpfs("shm", "1m")


def test_a_copy_never_fills_the_memory_file_system_past_three_quarters(tmp_path: Path, small_memory_fs: Path,
                                                                      caplog) -> None:
    source = MemorySnapshotDir(tmp_path / "source")
    job_dir = source.prepare(JOB, None, HostScope((1,), 2, 3))
    big = {name: np.zeros(200_000, dtype=np.float32) for name in "abcd"}  # rank 1 owns 2 of 800 kB each
    host_snapshot(job_dir, 10, (1,), world_size=2, tensors=big)
    assert source.newest(JOB) == Snapshot(10, 80)
    server = PeerServer(source, "127.0.0.1", None)
    peer = PeerAgent(node="host1", address=f"127.0.0.1:{server.start()}")
    local = MemorySnapshotDir(small_memory_fs)
    local.prepare(JOB, None, HostScope((0,), 2, 3))
    assert 0 < local.room_for_copies() <= 0.75 * (1 << 20)
    refusing = PeerCopier(local, PeerClient(None), JOB, peer, max_ranks=2, interval_s=0.02)
    copier = PeerCopier(local, PeerClient(None), JOB, peer, max_ranks=2, interval_s=0.02)
    try:
        with caplog.at_level(logging.WARNING, "agent.snapshots.peer_copier"):
            refusing.start()
            wait_until(lambda: any("there is room for" in r.message for r in caplog.records), 15, "the refusal")
        refusing.stop()  # it retries every poll: stopped, nothing half-copied may be left either
        assert copies(local, "host1") == []
        host_snapshot(job_dir, 20, (1,), world_size=2)  # a snapshot of a plausible size is copied
        assert source.newest(JOB) == Snapshot(20, 160)
        copier.start()
        wait_until(lambda: copies(local, "host1") == [step_dir_name(20)], 15, "the copy of step 20")
    finally:
        refusing.stop()
        copier.stop()
        server.stop()


def test_stopping_a_copier_ends_a_stalled_fetch_at_once_and_leaves_no_partial_copy(memory_fs: Path,
                                                                                    hostile_peer) -> None:
    stalling, peer = hostile_peer(pb.MemorySnapshot(step=50, ranks=[1], world_size=2, generation=3), stall=True)
    local = holder_memory(memory_fs, 0, steps=())
    client = PeerClient(None)
    copier = PeerCopier(local, client, JOB, peer, max_ranks=2, interval_s=0.02)
    copier.start()
    assert stalling.stalled.wait(15), "the fetch never started"
    assert copies(local, "host1") == [step_dir_name(50) + ".partial"]
    started = time.monotonic()
    copier.stop()
    assert time.monotonic() - started < 3  # not the fetch's 600 s timeout
    assert not any(t.name == "copier-host1" for t in threading.enumerate())
    assert copies(local, "host1") == []
    with pytest.raises(SnapshotAssemblyError, match="closed"):  # the copier's client makes no call after
        client.list_snapshots(peer, JOB, 5)


def test_a_report_of_another_rank_or_step_is_refused_and_nothing_is_written(tmp_path: Path, hostile_peer) -> None:
    _, peer = hostile_peer(pb.MemorySnapshot(step=50, ranks=[1], world_size=2, generation=3))  # serves rank 1's
    into = tmp_path / "into"
    into.mkdir()
    client = PeerClient(None)
    try:
        for rank, step in ((0, 50), (1, 60)):
            with pytest.raises(SnapshotAssemblyError, match="its report is of rank 1, step 50, file 'rank_1"):
                client.fetch_rank(peer, JOB, step, rank, into, 10)
            assert list(into.iterdir()) == []
    finally:
        client.close()
