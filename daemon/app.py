"""Production wiring of `trainerd start`: etcd (external or embedded), store, coordinator, gRPC."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import os
import signal
import socket
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.ca_pin import ca_pin
from common.cert_identity import names_host
from common.clock import SystemClock
from common.config_file import parse_host_port
from common.grpc_keepalive import handshake_options, keepalive_options
from common.listen_check import why_cannot_listen
from common.tls_files import TlsFiles
from daemon import metrics
from daemon.admission import OpeningGate
from daemon.certs import LEAF_VALIDITY, Issued, load_ca_files
from daemon.config import WILDCARD_HOSTS, ClusterConfig, ClusterSettings
from daemon.coordinator import Coordinator
from daemon.errors import PermanentError
from daemon.etcd_process import EmbeddedEtcd
from daemon.etcd_supervisor import EtcdSupervisor
from daemon.grpc_errors import ErrorStatusInterceptor
from daemon.grpc_services import DEFAULT_MAX_SESSIONS, ControlService, CoordinatorService
from daemon.join_services import BootstrapService, JoinTerms, NodeDesk
from daemon.leader import LeaderRecord
from daemon.local_agents import LocalAgents
from daemon.metrics_listener import start_metrics_server
from daemon.node_authority import NodeAuthority
from daemon.peer_auth import PeerAuthorizationInterceptor
from daemon.store.etcd import EtcdStore
from proto import trainerd_pb2_grpc as pb_grpc
from proto.vocabulary import MAX_WELCOME_WAIT_S

log = logging.getLogger(__name__)

# How long a trainerd stopping with local agents waits for the checkpoint it asked its job for: a save of
# the running job, not a hang's worth (a second Ctrl-C, or SIGTERM, stops at once).
SAVE_BEFORE_STOP_S = 60.0

COORDINATOR_SERVICE = "trainerd.v1.Coordinator"
CONTROL_SERVICE = "trainerd.v1.Control"

SERVER_OPTIONS = [
    # Close the connection of an agent that stopped answering (a host that lost power or its link sends no
    # FIN, a frozen process) 30 s after it was last heard, and keep NATs open. The agent's own channel
    # waits as long (agent/session.py): in a connect burst the simulated agents' loops ran 2 s late and
    # their writes waited up to 10 s (bench/heartbeats.py), and its liveness is the heartbeats' business.
    *keepalive_options(ping_every_s=10, answer_within_s=20, without_calls=True),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
    *handshake_options(),
]


def call_backlog_options(max_sessions: int) -> list[tuple[str, int]]:
    """How many calls the gRPC core holds while they wait for the event loop to take them, and how long:
    as many as the sessions the coordinator may hold (twice that before it refuses every one), each as
    long as an agent waits for its Welcome (MAX_WELCOME_WAIT_S).

    The aio server hands calls over more slowly than a burst brings them (30 to 1,400 a second measured
    at 10,000 agents, while the loop turned thousands of times a second), so in a connect burst or after
    a failover thousands wait in the core, for up to 25 s (agent/session.py waits that out). At gRPC's
    defaults (1,000, hard limit 3,000) it cancels them at random past 1,000: the agent sees `CANCELLED`,
    or `INTERNAL` when its Hello write meets the ended stream, and tries again, which feeds the burst. At
    10,000 agents at once that was 20,000 to 30,000 failed attempts (bench/heartbeats.md). The coordinator
    answers overload itself, with a retry-after hint the agents follow (daemon/admission.py).

    gRPC also cancels a call that waited 30 s (`grpc.server_max_unrequested_time_in_server`), though its
    agent would wait 60: at 20,000 agents at once, 788 to 7,077 attempts a run ended `CANCELLED` so, and
    went to the back of the queue again. A call older than the agent's wait has been given up anyway."""
    held = max(1000, max_sessions)
    return [("grpc.server.max_pending_requests", held),
            ("grpc.server.max_pending_requests_hard_limit", 2 * held),
            ("grpc.server_max_unrequested_time_in_server", math.ceil(MAX_WELCOME_WAIT_S))]


def grpc_server(check_peers: bool = False, max_sessions: int = DEFAULT_MAX_SESSIONS) -> grpc.aio.Server:
    """The coordinator's gRPC server: keepalive options, a call backlog for `max_sessions` sessions, and
    the coordinator's errors answered as status codes (daemon/grpc_errors.py) by every method of every
    service. With `check_peers` (a TLS server that requires client certificates), every call's
    certificate is checked against what it may call first (daemon/peer_auth.py)."""
    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = (ErrorStatusInterceptor(),)
    if check_peers:
        interceptors += (PeerAuthorizationInterceptor(),)
    return grpc.aio.server(options=SERVER_OPTIONS + call_backlog_options(max_sessions),
                           interceptors=interceptors)


def add_listener(server: grpc.aio.Server, address: str, tls: TlsFiles | None) -> int:
    """Serve `address`: with TLS, admitting only clients with a certificate of the CA; in plain text
    otherwise (the cluster file allows that only on loopback or with `insecure: true`). Returns the
    port; RuntimeError when it cannot be bound."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())


def join_address(cluster: ClusterSettings) -> str:
    """Where joining agents reach the Bootstrap service: join.listen, with the advertised host when it
    listens on every address."""
    assert cluster.join is not None
    host, port = parse_host_port(cluster.join.listen)
    if host in WILDCARD_HOSTS:
        host, _ = parse_host_port(cluster.coordinator.advertised)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def load_join_ca(config: ClusterConfig) -> Issued | None:
    """The CA (cluster.tls.ca_file) with its key (cluster.join.ca_key_file) when the cluster joins hosts;
    CertificateError, one line, when they cannot be read or do not belong together."""
    cluster = config.cluster
    if cluster.join is None or cluster.tls is None:
        return None
    return load_ca_files(Path(cluster.tls.ca_file), Path(cluster.join.ca_key_file),
                         "cluster.join.ca_key_file must name the CA's key (ca.key, beside ca.crt)")


def bootstrap_server(address: str, tls: TlsFiles, authority: NodeAuthority) -> grpc.aio.Server:
    """The listener of joining agents: TLS with the coordinator's certificate and no client certificate
    (gRPC asks every client of a port for one or none), serving Bootstrap alone, so nothing else is ever
    reachable without a certificate. ListenError when `address` cannot be bound."""
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=(ErrorStatusInterceptor(),))
    pb_grpc.add_BootstrapServicer_to_server(BootstrapService(authority, tls.ca), server)
    try:
        server.add_secure_port(address, grpc.ssl_server_credentials([(tls.key, tls.cert)]))
    except RuntimeError as exc:
        raise ListenError(f"cannot listen on {address}: the address is in use or not local "
                          f"(cluster.join.listen)") from exc
    return server


# Allocations (net of deallocations) between two collections of the youngest generation while serving;
# CPython's default is 700. See settle_gc_for_serving.
GC_YOUNG_THRESHOLD = 50_000


def settle_gc_for_serving() -> None:
    """Keep Python's cyclic garbage collector from stopping the event loop for a second at a time.

    A collection holds the GIL, and a full one walks every object the process holds. With 10,000 agents
    connecting at once (bench/heartbeats.py --agents 10000 --max-opening 256, 2 cores), CPython's default
    thresholds (700, 10, 10) ran a full collection every few seconds while the sessions piled up: 27 to
    38 per run, up to 0.96 s of CPU (2.2 s of wall clock) each, 14 to 19 s of the leader's CPU in
    collections per run, and its loop ran 3.2 to 18.5 s late in all. With the start-up heap (modules, the
    gRPC and etcd clients) frozen out of every collection and a young generation of 50,000, the same
    runs (alternating with those, 5 each) did no full collection, spent 1.7 to 3.6 s of CPU in
    collections, the longest 0.26 s, ran 0 to 3.6 s late in all and welcomed every agent each time, in 76
    to 150 s (the defaults did not, within 180 s, in 3 runs of 5). Broken sessions and false LOST stayed
    noisy (medians 2,121 and 341 against 4,034 and 1,513, the ranges overlapping), and the process held
    about 50 MB more.

    Cyclic garbage is still collected, in larger and rarer batches. Called once, after start-up, before
    the first agent is served."""
    gc.collect()  # nothing freed at start-up is kept for good
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 50, 100)


class ListenError(PermanentError):
    """The coordinator's gRPC address cannot be bound (in use, or not an address of this host): free the
    port or fix cluster.coordinator.listen, then start again."""


class TrainerdApp:
    def __init__(self, config: ClusterConfig, tls: TlsFiles | None = None, join_ca: Issued | None = None) -> None:
        """`tls`: the files cluster.tls names, read (common.tls_files.read_tls_files); `join_ca`: the CA with
        the key cluster.join.ca_key_file names (`load_join_ca`), to sign joining hosts' certificates."""
        self._config = config
        self._tls = tls
        self._join_ca = join_ca
        self._etcd: EmbeddedEtcd | None = None
        self._store: EtcdStore | None = None
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._local_agents: LocalAgents | None = None
        self._bootstrap: grpc.aio.Server | None = None
        self.coordinator: Coordinator | None = None

    async def _open_store(self) -> EtcdStore:
        etcd = self._config.cluster.etcd
        endpoints = list(etcd.endpoints)
        if endpoints:
            return await EtcdStore.connect(
                endpoints, ca_file=etcd.ca_file, cert_file=etcd.cert_file, key_file=etcd.key_file,
                username=etcd.username, password=etcd.password,
            )
        client_host, client_port = parse_host_port(etcd.client_listen)
        peer_host, peer_port = parse_host_port(etcd.peer_listen)
        tls = self._config.cluster.tls
        self._etcd = EmbeddedEtcd(self._config.resolve(etcd.data_dir), client_port, peer_port,
                                  client_host=client_host, peer_host=peer_host, tls=tls)
        await self._etcd.start()
        log.info("embedded etcd serving at %s (%s), data in %s", self._etcd.endpoint,
                 "TLS, coordinator certificates of the cluster's CA only" if tls else "plain text",
                 self._config.resolve(etcd.data_dir))
        if tls is None:
            return await EtcdStore.connect([self._etcd.endpoint])
        return await EtcdStore.connect([self._etcd.endpoint], ca_file=tls.ca_file, cert_file=tls.cert_file,
                                       key_file=tls.key_file)

    async def run(self, stop: asyncio.Event) -> None:
        cluster = self._config.cluster
        # Bind first: a second trainerd with the same address fails here, before it touches etcd.
        self._server = grpc_server(check_peers=self._tls is not None,
                                   max_sessions=cluster.coordinator.max_sessions)
        for key, address in (("listen", cluster.coordinator.listen),
                             ("metrics_listen", cluster.coordinator.metrics_listen)):
            reason = why_cannot_listen(address) if address else None
            if reason is not None:
                raise ListenError(f"cannot listen on {address}: {reason} (cluster.coordinator.{key})")
        try:
            add_listener(self._server, cluster.coordinator.listen, self._tls)
        except RuntimeError as exc:
            raise ListenError(f"cannot listen on {cluster.coordinator.listen}: the address is in use or not "
                              f"local (cluster.coordinator.listen)") from exc
        tasks: list[asyncio.Task] = []
        try:
            self._store = await self._open_store()
            if self._etcd is not None:
                tasks.append(asyncio.create_task(EtcdSupervisor(self._etcd, SystemClock()).run(),
                                                 name="embedded etcd supervisor"))
            me = LeaderRecord(id=f"{socket.gethostname()}:{os.getpid()}",
                              address=cluster.coordinator.advertised)
            job_name = self._config.job.name if self._config.job else cluster.name
            if self._config.job is None:
                log.warning("the cluster file has no job: section; trainerd keeps its nodes' membership and runs "
                            "nothing (add a job and start it again)")
            gate = OpeningGate(SystemClock(), cluster.coordinator.max_opening_sessions)
            coordinator = self.coordinator = Coordinator(
                store=self._store, clock=SystemClock(), me=me, job_name=job_name, job=self._config.job,
                heartbeat_interval_s=cluster.heartbeat.interval_s,
                heartbeat_timeout_s=cluster.heartbeat.timeout_s,
                heartbeat_max_per_s=cluster.heartbeat.max_per_s,
                session_grace_s=cluster.heartbeat.grace_s,
                forget_lost_after_s=cluster.heartbeat.forget_lost_after_s,
                events_keep=cluster.events.keep, events_max_age_s=cluster.events.max_age_s,
                leader_lease_s=cluster.coordinator.leader_lease_s,
                on_leadership_change=self._publish_leadership,
                agents_at_the_door=gate.agents_at_the_door,
            )
            desk = None
            if self._tls is not None:
                desk = self._node_desk(coordinator, self._store)
                tasks.append(asyncio.create_task(desk.authority.run(), name="revoked certificates"))
            metrics.SESSIONS.set_function(lambda: coordinator.session_count)
            metrics.SESSIONS_OPENING.set_function(lambda: gate.opening)
            if cluster.coordinator.metrics_listen:
                try:
                    start_metrics_server(cluster.coordinator.metrics_listen, cluster.tls)
                except OSError as exc:  # taken since it was checked above
                    raise ListenError(f"cannot listen on {cluster.coordinator.metrics_listen}: {exc.strerror or exc} "
                                      f"(cluster.coordinator.metrics_listen)") from exc
            pb_grpc.add_CoordinatorServicer_to_server(
                CoordinatorService(self.coordinator, cluster.coordinator.max_sessions, gate=gate, desk=desk),
                self._server)
            pb_grpc.add_ControlServicer_to_server(ControlService(self.coordinator, desk), self._server)
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
            settle_gc_for_serving()
            await self._server.start()
            if self._bootstrap is not None:
                await self._bootstrap.start()
                assert cluster.join is not None
                log.info("joining hosts with a token at %s", cluster.join.listen)
            await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
            await self._health.set(CONTROL_SERVICE, health_pb2.HealthCheckResponse.SERVING)
            if self.coordinator.leadership is None:
                await self._health.set(COORDINATOR_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
            log.info("trainerd %s serving on %s (%s)", me.id, cluster.coordinator.listen,
                     "TLS, client certificates of its CA only" if self._tls else "plain text")
            self._warn_of_an_unnamed_address()

            tick_s = min(0.5, cluster.heartbeat.interval_s / 2)
            leading = asyncio.create_task(self.coordinator.run(tick_s), name="coordinator")
            tasks.append(leading)
            if cluster.local_agents:
                self._local_agents = LocalAgents(
                    count=cluster.local_agents, coordinator_address=cluster.coordinator.advertised,
                    cluster_name=cluster.name,
                    work_root=self._config.resolve(cluster.local_agent.work_dir),
                    cpu_devices=cluster.local_agent.cpu_devices,
                    compile_cache=cluster.local_agent.compile_cache,
                    warm_workers=cluster.local_agent.warm_workers,
                )
                await self._local_agents.start()
            stopping = asyncio.create_task(stop.wait())
            tasks.append(stopping)
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done - {stopping}:
                task.result()  # re-raise what ended the coordinator, or why etcd cannot be kept running
            if self._local_agents is not None:
                await self._save_before_stopping(stop)
        finally:
            # The supervisor ends before _shutdown stops etcd (no death to restart from); the
            # coordinator resigns its leadership.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._shutdown()

    def _node_desk(self, coordinator: Coordinator, store: EtcdStore) -> NodeDesk:
        """Revocations always with TLS; with cluster.join, the CA's key to sign with and the Bootstrap
        listener (bound here, started with the coordinator's)."""
        assert self._tls is not None
        cluster = self._config.cluster
        terms = None
        if cluster.join is not None:
            terms = JoinTerms(ca_pin(self._tls.ca), join_address(cluster), (cluster.coordinator.advertised,))
        authority = NodeAuthority(store, self._join_ca,
                                  cluster.join.certificate_validity if cluster.join else LEAF_VALIDITY, time.time)
        if cluster.join is not None:
            self._bootstrap = bootstrap_server(cluster.join.listen, self._tls, authority)
        return NodeDesk(coordinator, authority, terms)

    def _warn_of_an_unnamed_address(self) -> None:
        """A standby names the leader's advertised address to agents, which refuse a certificate that does not
        name it; say so at start, not in every agent's log after a failover."""
        advertised = self._config.cluster.coordinator.advertised
        host, _ = parse_host_port(advertised)
        if self._tls is None or host in WILDCARD_HOSTS or names_host(self._tls.cert, host):
            return
        cert_file = self._config.cluster.tls.cert_file if self._config.cluster.tls else "its certificate"
        log.warning("the coordinator's certificate (%s) does not name %s, the address it advertises: agents sent "
                    "there refuse it; reissue it with `trainerd certs coordinator --dir DIR --host %s --force` "
                    "(and every other name agents dial)", cert_file, host, host)

    async def _save_before_stopping(self, stop: asyncio.Event) -> None:
        """The local agents, and the training processes they run, stop with trainerd: the running generation
        saves a checkpoint first, unless it takes longer than SAVE_BEFORE_STOP_S or the stop is asked again."""
        assert self.coordinator is not None
        stop.clear()
        saving = asyncio.create_task(self.coordinator.save_before_stopping(SAVE_BEFORE_STOP_S))
        again = asyncio.create_task(stop.wait())
        await asyncio.wait({saving, again}, return_when=asyncio.FIRST_COMPLETED)
        if not saving.done():
            log.warning("stopping at once, without the checkpoint")
        elif saving.exception() is not None:
            log.warning("the checkpoint before stopping was not asked for: %s", saving.exception())
        for task in (saving, again):
            task.cancel()
        await asyncio.gather(saving, again, return_exceptions=True)

    def _publish_leadership(self, is_leader: bool) -> None:
        """Health of the Coordinator service follows leadership, so probes find the leader."""
        metrics.IS_LEADER.set(1 if is_leader else 0)
        status = health_pb2.HealthCheckResponse.SERVING if is_leader else health_pb2.HealthCheckResponse.NOT_SERVING
        asyncio.get_running_loop().create_task(self._health.set(COORDINATOR_SERVICE, status))

    async def _shutdown(self) -> None:
        log.info("trainerd shutting down")
        await self._health.enter_graceful_shutdown()
        if self._local_agents is not None:
            await self._local_agents.stop()
        if self._bootstrap is not None:
            await self._bootstrap.stop(grace=1.0)
        if self._server is not None:
            await self._server.stop(grace=2.0)
        if self._store is not None:
            await self._store.close()
        if self._etcd is not None:
            await self._etcd.stop()


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
