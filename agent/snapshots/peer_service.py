"""The agent's SnapshotPeer server: its pinned in-memory snapshots (agent/snapshots/memory_snapshots.py), served to the
other agents of the cluster, which copy them (agent/snapshots/peer_copier.py) or fetch them for a relaunch.

A synchronous gRPC server on a few threads of its own, so that streaming files never holds up the agent's
asyncio loop; the pool's size bounds the streams served at once, and its threads run at the lowest CPU
priority (agent/thread_priority.py). With TLS it listens on `host` and admits
only clients whose certificate (verified against the cluster's CA) is that of a node of the generation this
agent was last launched in (`Launch.peer_nodes`, handed to `serve_generation`; none before the first
Launch), each with at most PEER_CALLS_PER_CERTIFICATE calls at once, so that a certificate of another
generation reads nothing and one node's stalled fetches cannot take the pool from the others; without TLS
it listens on loopback only, whatever `host` says: snapshots hold the whole model. Every request comes from the network:
the job name must be a plain directory name, the step and rank in range, and the files are opened from the
memory root down without following any link.
"""

from __future__ import annotations

import logging
import math
import os
import stat
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import grpc

from agent.job_workdir import is_plain_job_name
from agent.snapshots.memory_snapshots import MemorySnapshotDir
from agent.thread_priority import lower_this_threads_priority
from common.cert_identity import CertificateError, PeerKind, peer_identity, serial_of, serves_as_node
from common.grpc_keepalive import handshake_options
from common.listen_check import why_cannot_listen
from common.stream_quota import QuotaExceeded, StreamQuota
from common.tls_files import TlsFiles
from proto import trainerd_pb2 as pb
from proto import trainerd_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
MAX_RANK = 1 << 20
WORKERS = 4               # streams served at once
MAX_QUEUED_RPCS = 4 * WORKERS  # calls beyond this are refused (RESOURCE_EXHAUSTED) rather than queued
MAX_REQUEST_BYTES = 4096  # a request holds a job name and three numbers
# A peer fetches one file at a time: its copier's and a relaunch's fetch may overlap.
PEER_CALLS_PER_CERTIFICATE = 2
# A waiting ListSnapshots holds one of the WORKERS threads: at most this long, looking at the workers' directory
# (a few stat calls) this often.
MAX_LIST_WAIT_S = 5.0
LIST_LOOK_INTERVAL_S = 0.05
_FILE_KINDS = (pb.PEER_FILE_DATA, pb.PEER_FILE_REPORT)
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class PeerServer:
    """Serves `memory`'s pinned snapshots on `port` (0: any free one); `tls`: the agent's node certificate
    (None: loopback only)."""

    def __init__(self, memory: MemorySnapshotDir, host: str, tls: TlsFiles | None, port: int = 0,
                 max_list_wait_s: float = MAX_LIST_WAIT_S) -> None:
        self._host = host
        self._tls = tls
        self._port = port
        self._server: grpc.Server | None = None
        self._servicer = _Servicer(memory, tls is not None, max_list_wait_s)

    def refuse(self, serials: frozenset[str]) -> None:
        """The cluster's revoked certificates (the coordinator's Revocations): refused from the next call on."""
        self._servicer.revoked = serials

    def serve_generation(self, generation: int, nodes: Iterable[str]) -> None:
        """Serve the nodes of `generation` (a Launch's `peer_nodes`) from now on, unless a newer one was named."""
        self._servicer.serve_generation(generation, frozenset(nodes))

    def start(self) -> int:
        """Listen and serve; returns the port bound, or 0 when the node certificate was made before node
        certificates could serve (`serves_as_node`): then no peer may copy from this agent, which says so.
        OSError when no port can be bound."""
        if self._tls is not None and not serves_as_node(self._tls.cert):
            log.warning("serving no in-memory snapshots to peers: this node's certificate cannot serve (made "
                        "before trainerd's node certificates had serverAuth); issue a new one with `trainerd "
                        "certs node`")
            return 0
        server = grpc.server(
            ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="peer-server",
                               initializer=lower_this_threads_priority),
            maximum_concurrent_rpcs=MAX_QUEUED_RPCS,
            options=[("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                     ("grpc.max_send_message_length", CHUNK_BYTES + 1024), *handshake_options()],
        )
        pb_grpc.add_SnapshotPeerServicer_to_server(self._servicer, server)
        if self._tls is None:
            address = f"127.0.0.1:{self._port}"
        else:
            address = f"[{self._host}]:{self._port}" if ":" in self._host else f"{self._host}:{self._port}"
        reason = why_cannot_listen(address) if self._port else None
        if reason is not None:
            raise OSError(f"the snapshot peer server cannot listen on {address}: {reason}")
        try:  # grpc answers 0 or raises, depending on its version
            port = (server.add_insecure_port(address) if self._tls is None
                    else server.add_secure_port(address, self._tls.server_credentials()))
        except RuntimeError:
            port = 0
        if port == 0:
            raise OSError(f"the snapshot peer server cannot listen on {address}")
        server.start()
        self._server = server
        log.info("serving in-memory snapshots to peers on %s, port %d (%s)", address.rsplit(":", 1)[0], port,
                 "TLS, node certificates only" if self._tls else "no TLS: loopback only")
        return port

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None


class _Servicer(pb_grpc.SnapshotPeerServicer):
    def __init__(self, memory: MemorySnapshotDir, require_node: bool, max_list_wait_s: float) -> None:
        self._memory = memory
        self._require_node = require_node
        self._max_list_wait_s = max_list_wait_s
        # Replaced whole from the agent's loop, read by the server's threads: no lock needed.
        self.revoked: frozenset[str] = frozenset()
        self._quota = StreamQuota(PEER_CALLS_PER_CERTIFICATE)
        self._lock = threading.Lock()
        self._generation = 0
        self._peers: frozenset[str] = frozenset()

    def serve_generation(self, generation: int, nodes: frozenset[str]) -> None:
        with self._lock:
            if generation >= self._generation:
                self._generation, self._peers = generation, nodes

    def ListSnapshots(self, request: pb.PeerListRequest, context: grpc.ServicerContext) -> pb.PeerListReply:
        """The pinned snapshots, once one is newer than `newer_than_step` or `wait_s` (at most the server's
        `max_list_wait_s`) has passed: the ring copier waits here for the next snapshot rather than asking ten
        times a second."""
        with self._admitted(context):
            job = request.job_name
            _check_job(job, context)
            wait_s = request.wait_s if math.isfinite(request.wait_s) else 0.0
            deadline = time.monotonic() + min(max(wait_s, 0.0), self._max_list_wait_s)
            seen: tuple[tuple[str, int], ...] | None = None
            own: list[pb.MemorySnapshot] = []
            while True:
                changed = self._memory.workers_changed(job)
                if changed != seen:
                    seen = changed
                    # Pin first: the workers' newest complete step is copied within a look of being written,
                    # not a heartbeat later (the agent pins at each heartbeat otherwise).
                    self._memory.newest(job)
                    own = self._memory.own_snapshots(job)
                    if any(held.step > request.newer_than_step for held in own):
                        break
                if time.monotonic() >= deadline or not context.is_active():
                    break
                time.sleep(LIST_LOOK_INTERVAL_S)
            return pb.PeerListReply(own=own)

    def FetchFile(self, request: pb.PeerFetchRequest, context: grpc.ServicerContext) -> Iterator[pb.PeerChunk]:
        with self._admitted(context):
            _check_job(request.job_name, context)
            if request.step < 0 or not 0 <= request.rank < MAX_RANK or request.kind not in _FILE_KINDS:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {request.step}, rank {request.rank} or "
                                                                f"file kind {request.kind} out of range")
            path = self._memory.rank_file(request.job_name, request.step, request.rank, request.kind)
            fd = None if path is None else _open_below(self._memory.root, path)
            if fd is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"step {request.step} of rank {request.rank} of job "
                                                         f"{request.job_name} is not pinned here")
            assert fd is not None  # abort raises
            with os.fdopen(fd, "rb", buffering=0) as f:
                while chunk := f.read(CHUNK_BYTES):
                    yield pb.PeerChunk(data=chunk)

    @contextmanager
    def _admitted(self, context: grpc.ServicerContext) -> Iterator[None]:
        """With TLS, only a node (PERMISSION_DENIED otherwise) of the generation named last (FAILED_PRECONDITION)
        may read the snapshots, and only with its share of the calls (RESOURCE_EXHAUSTED)."""
        if not self._require_node:
            yield
            return
        certificates = context.auth_context().get("x509_pem_cert", [])
        try:
            if not certificates:
                raise CertificateError("the client presented no certificate")
            identity = peer_identity(certificates[0])
            if identity.kind is not PeerKind.NODE:
                raise CertificateError(f"{identity.kind.value} {identity.name} is not a node")
            if serial_of(certificates[0]) in self.revoked:
                raise CertificateError(f"the certificate of node {identity.name} is revoked")
        except CertificateError as exc:
            log.warning("refused a snapshot peer call from %s: %s", context.peer(), exc)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"only agents may read snapshots: {exc}")
        with self._lock:
            generation, peers = self._generation, self._peers
        if identity.name not in peers:
            # FAILED_PRECONDITION, not PERMISSION_DENIED: the Launch naming it may still be on its way here.
            log.warning("refused a snapshot peer call of node %s: not of generation %d", identity.name, generation)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"node {identity.name} is not of generation {generation}, the one this agent was launched "
                          f"in last" if generation else f"this agent has not been launched since it started, so node "
                          f"{identity.name} is of no generation of it")
        with ExitStack() as held:
            try:
                held.enter_context(self._quota.held(identity, f"node {identity.name}"))
            except QuotaExceeded as exc:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            yield


def _check_job(job: str, context: grpc.ServicerContext) -> None:
    if not is_plain_job_name(job):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"job name {job!r:.80} is not a plain directory name")


def _open_below(root: Path, path: Path) -> int | None:
    """A descriptor of the regular file `path`, opened from `root` one component at a time without following
    a link (the job's directory is the workers': they could put one anywhere below it); None otherwise."""
    parts = path.relative_to(root).parts
    fds: list[int] = []
    try:
        fds.append(os.open(root, _DIRECTORY_FLAGS))
        for part in parts[:-1]:
            fds.append(os.open(part, _DIRECTORY_FLAGS, dir_fd=fds[-1]))
        fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=fds[-1])
    except OSError:
        return None
    finally:
        for opened in fds:
            os.close(opened)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd
