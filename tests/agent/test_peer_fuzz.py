"""Fuzz the agent's real SnapshotPeer server (agent/snapshots/peer_service.py) over real mutual TLS on 127.0.0.1:
hypothesis-generated PeerListRequests and PeerFetchRequests (extreme numbers, hostile job names and kinds)
and byte-mutated ones, from a node of the generation it serves. Every answer is a status the request earned
(never INTERNAL or UNKNOWN, but for bytes that do not parse, which gRPC refuses before any servicer, as it
refuses one of more than MAX_REQUEST_BYTES), what it serves is only a pinned file, and after every case an honest peer still
lists and fetches.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.commands import PeerAgent
from agent.snapshots.memory_snapshots import HostScope, MemorySnapshotDir
from agent.snapshots.peer_client import PeerClient
from agent.snapshots.peer_service import MAX_REQUEST_BYTES, PeerServer
from common.cert_identity import node_server_name
from common.tls_files import TlsFiles
from daemon.certs import Issued, make_ca, make_node_certificate
from proto import trainerd_pb2 as pb
from tests.agent.snapshot_files import host_snapshot
from tests.daemon.test_servicer_fuzz import messages, mutated_bytes

CASES = 300
RPC_TIMEOUT_S = 15.0
JOB, SERVER_NODE, FUZZ_NODE, HONEST_NODE = "job", "holder", "fuzz", "honest"
# What a request may be answered with: served, or refused for what it asked or how often.
EARNED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
          grpc.StatusCode.RESOURCE_EXHAUSTED}
METHODS = {"ListSnapshots": pb.PeerListRequest, "FetchFile": pb.PeerFetchRequest}


def tls_of(ca: Issued, leaf: Issued) -> TlsFiles:
    return TlsFiles(ca.certificate_pem(), leaf.certificate_pem(), leaf.key_pem())


class LiveHolder:
    """A SnapshotPeer serving step 50 of rank 1 to the nodes of its generation, and a raw channel into it."""

    def __init__(self, root: Path) -> None:
        ca = make_ca()
        self.memory = MemorySnapshotDir(root / "holder")
        host_snapshot(self.memory.prepare(JOB, None, HostScope((1,), 2, 3)), 50, (1,), world_size=2)
        self.memory.newest(JOB)
        # A short bound on a list's wait: a fuzzed wait_s is honoured, up to it, without the fuzzing taking minutes.
        self.server = PeerServer(self.memory, "127.0.0.1", tls_of(ca, make_node_certificate(ca, SERVER_NODE)),
                                 max_list_wait_s=0.05)
        self.server.serve_generation(3, (FUZZ_NODE, HONEST_NODE))
        self.holder = PeerAgent(node=SERVER_NODE, address=f"127.0.0.1:{self.server.start()}")
        self.channel = grpc.secure_channel(self.holder.address,
                                           tls_of(ca, make_node_certificate(ca, FUZZ_NODE)).channel_credentials(),
                                           options=[("grpc.ssl_target_name_override", node_server_name(SERVER_NODE))])
        self.honest = PeerClient(tls_of(ca, make_node_certificate(ca, HONEST_NODE)))

    def call(self, method: str, request: bytes) -> tuple[grpc.StatusCode, bytes]:
        """The request's bytes as sent, and the status and bytes of the answer."""
        path = f"/trainerd.v1.SnapshotPeer/{method}"
        try:
            if method == "ListSnapshots":
                return grpc.StatusCode.OK, self.channel.unary_unary(path)(request, timeout=RPC_TIMEOUT_S)
            return grpc.StatusCode.OK, b"".join(self.channel.unary_stream(path)(request, timeout=RPC_TIMEOUT_S))
        except grpc.RpcError as exc:
            return exc.code(), b""

    def close(self) -> None:
        self.honest.close()
        self.channel.close()
        self.server.stop()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveHolder]:
    holder = LiveHolder(tmp_path_factory.mktemp("peer-fuzz"))
    yield holder
    holder.close()


def requests() -> st.SearchStrategy[tuple[str, bytes]]:
    """A request of either method: generated, or its bytes mutated (what no client library would send)."""
    def encoded(method: str) -> st.SearchStrategy[tuple[str, bytes]]:
        generated = messages(METHODS[method].DESCRIPTOR).map(lambda message: message.SerializeToString())
        return st.tuples(st.just(method), st.one_of(generated, mutated_bytes(generated)))
    return st.sampled_from(sorted(METHODS)).flatmap(encoded)


CASES_RUN: list[str] = []


@settings(max_examples=CASES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(request=requests())
def test_fuzzed_requests_are_answered_with_what_they_earned_and_serve_only_pinned_files(
        live: LiveHolder, request: tuple[str, bytes]) -> None:
    method, data = request
    CASES_RUN.append(method)
    code, answer = live.call(method, data)
    if len(data) > MAX_REQUEST_BYTES:  # gRPC refuses it before the servicer
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, (method, data[:200], code)
        return
    try:
        METHODS[method].FromString(data)
    except DecodeError:  # gRPC refuses it before the servicer, "Exception deserializing request!"
        assert code is grpc.StatusCode.INTERNAL, (method, data[:200], code)
    else:
        assert code in EARNED, (method, data[:200], code)
    if method == "FetchFile" and code is grpc.StatusCode.OK:
        asked = pb.PeerFetchRequest.FromString(data)
        path = live.memory.rank_file(asked.job_name, asked.step, asked.rank, asked.kind)
        assert path is not None and answer == path.read_bytes()


def test_after_the_fuzzing_an_honest_peer_still_lists_and_fetches(live: LiveHolder, tmp_path: Path) -> None:
    assert len(CASES_RUN) == CASES, "run with the fuzz test before it"
    assert [s.step for s in live.honest.list_snapshots(live.holder, JOB, RPC_TIMEOUT_S)] == [50]
    live.honest.fetch_rank(live.holder, JOB, 50, 1, tmp_path, RPC_TIMEOUT_S)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_1.done.json", "rank_1.safetensors"]
    print(f"\npeer fuzz: {len(CASES_RUN)} requests, {CASES_RUN.count('FetchFile')} of them fetches")
