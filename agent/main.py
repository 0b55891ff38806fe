"""`trainerd-agent`: the per-host service that registers devices and runs training processes."""

from __future__ import annotations

from common import grpc_core_settings

grpc_core_settings.apply()  # before anything imports grpc: its core reads these settings then

import asyncio
import datetime
import logging
import signal
import sys
from pathlib import Path
from typing import assert_never

import click
import grpc
from click.core import ParameterSource
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from agent.commands import (
    CheckpointNow,
    Command,
    Launch,
    NodeCertificate,
    NodeCheck,
    ReadLog,
    RequestExit,
    Revocations,
    Standby,
    Stop,
)
from agent.compile_cache import CompileCacheLauncher
from agent.config import AgentConfig, load_agent_config, memory_root
from agent.devices import Device, NoDevicesError, discover_devices
from agent.join import JoinFailed, Renewal, check_join_options, has_stored_files, join, stored_tls
from agent.launcher import ProcessLauncher, SubprocessLauncher
from agent.node_check import run_node_check
from agent.progress_receiver import open_progress_receiver
from agent.session import CoordinatorLink, IdentityFile
from agent.snapshots import MemorySnapshotDir, PeerClient, PeerServer
from agent.stack_dump import PySpyDumper
from agent.supervisor import Supervisor
from agent.systemd import SystemdNotifier
from agent.warm_launcher import WarmLauncher
from agent.worker_user import WorkerUser
from common.ca_pin import check_pin
from common.cert_identity import CertificateError, PeerKind, peer_identity
from common.clock import Clock, SystemClock
from common.config_file import ConfigError, is_loopback_host
from common.start_refused import StartRefused
from common.tls_files import (
    TLS_ENV,
    TLS_OPTION_NAMES,
    TlsFiles,
    TlsSettings,
    read_tls_files,
    tls_settings_from_options,
)
from proto import trainerd_pb2 as pb
from proto.launch_env import JOIN_TOKEN_ENV

AGENT_VERSION = "0.1.0"
FENCE_CHECK_INTERVAL_S = 0.2
RENEWAL_CHECK_S = 3600.0
log = logging.getLogger("agent")


class Agent:
    """Serves one host: runs the coordinator link, hands its commands to the supervisor and relays
    worker progress; it is the link's `SessionHandler`."""

    def __init__(self, config: AgentConfig, *, link: CoordinatorLink, supervisor: Supervisor,
                 notifier: SystemdNotifier, clock: Clock, launcher: ProcessLauncher,
                 peer_server: PeerServer | None = None, peer_client: PeerClient | None = None,
                 renewal: Renewal | None = None) -> None:
        self._config = config
        self._renewal = renewal
        self._peer_server = peer_server
        self._peer_client = peer_client
        self._launcher = launcher
        self._work_dir = Path(config.work_dir)
        self.link = link
        self.supervisor = supervisor
        self._notifier = notifier
        self._clock = clock
        self._health = health.aio.HealthServicer()
        self._tasks: set[asyncio.Task] = set()

    def heartbeat_body(self) -> pb.Heartbeat:
        return self.supervisor.heartbeat()

    def on_command(self, command: Command) -> None:
        match command:
            case Launch():
                if self._peer_server is not None:  # before any peer of the generation asks for a snapshot
                    self._peer_server.serve_generation(command.generation, command.peer_nodes)
                self._spawn(self.supervisor.launch(command))
            case Standby():
                self._spawn(self.supervisor.stand_by(command))
            case Stop():
                self._spawn(self.supervisor.stop(command))
            case CheckpointNow():
                self.supervisor.checkpoint_now(command)
            case RequestExit():
                self._spawn(self.supervisor.request_exit(command))
            case ReadLog():
                self._spawn(self._answer_read_log(command))
            case NodeCheck():
                self._spawn(self._answer_node_check(command))
            case NodeCertificate():
                if self._renewal is not None:
                    self._renewal.received(command.certificate_pem)
            case Revocations():
                if self._peer_server is not None:
                    self._peer_server.refuse(command.serials)
            case _:
                assert_never(command)

    async def _answer_read_log(self, request: ReadLog) -> None:
        self.link.send(pb.AgentMessage(log_data=await self.supervisor.read_log(request)))

    async def _answer_node_check(self, check: NodeCheck) -> None:
        log.info("running the node check %s", list(check.argv))
        result = await run_node_check(check, launcher=self._launcher, work_dir=self._work_dir,
                                      allowed_entrypoints=self._config.allowed_entrypoints)
        if result.passed:
            log.info("the node check passed")
        else:
            log.error("the node check failed: %s", result.detail)
        self.link.send(pb.AgentMessage(node_check_result=result))

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("command failed: %s", task.exception(), exc_info=task.exception())

    def on_connected(self, connected: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if connected else health_pb2.HealthCheckResponse.NOT_SERVING
        asyncio.get_running_loop().create_task(self._health.set("", status))
        if connected:
            self._notifier.ready(f"registered as {self._config.node_name}")
            self.supervisor.resend_reports()  # queued before the session forwards anything
            self._check_certificate()
        else:
            self._notifier.status("reconnecting to the coordinator")
            if self._renewal is not None:
                self._renewal.forget_request()

    def _check_certificate(self) -> None:
        if self._renewal is None:
            return
        try:
            self._renewal.check(datetime.datetime.now(datetime.timezone.utc))
        except (OSError, ValueError) as exc:
            log.warning("this node's certificate cannot be checked for renewal: %s", exc)

    async def _renewals(self) -> None:
        """A certificate comes due while a session runs for days: look at each session's start and hourly."""
        while True:
            await self._clock.asleep(RENEWAL_CHECK_S)
            if self.link.connected.is_set():
                self._check_certificate()

    async def _watchdog(self) -> None:
        """Ping systemd's watchdog only while the session is up, so a wedged agent gets restarted."""
        interval = self._notifier.watchdog_interval_s
        if interval is None:
            return
        while True:
            await self.link.connected.wait()
            self._notifier.watchdog()
            await self._clock.asleep(interval)

    async def _fence_watch(self) -> None:
        """Stop the running generation once no coordinator has answered for the heartbeat timeout: by
        then the coordinator has declared this node LOST and the job goes on without it."""
        contact = self.link.contact
        while True:
            await self._clock.asleep(FENCE_CHECK_INTERVAL_S)
            if contact.overdue() and contact.terms is not None:
                reason = f"no coordinator answered for {contact.silent_for():.1f}s (heartbeat timeout " \
                         f"{contact.terms.timeout_s:.1f}s)"
                await self.supervisor.fence(contact.terms.stop_grace_s, reason)

    async def run(self, stop: asyncio.Event) -> None:
        self._work_dir.mkdir(parents=True, exist_ok=True)
        self.supervisor.reap_orphans()
        memory = self.supervisor.memory
        if memory is not None:
            memory.clear()  # what a crashed predecessor left: its workers are gone, nobody resumes from it
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        health_socket = self._work_dir / "agent.sock"
        health_socket.unlink(missing_ok=True)
        server.add_insecure_port(f"unix:{health_socket}")
        await server.start()
        await self._health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        worker_user = self.supervisor.worker_user
        progress = await open_progress_receiver(self.supervisor.progress_socket, self.supervisor.on_progress,
                                                group=None if worker_user is None else worker_user.gid)
        tasks = [asyncio.create_task(self.link.run(self)), asyncio.create_task(self._watchdog()),
                 asyncio.create_task(self._fence_watch()), asyncio.create_task(self._renewals()),
                 asyncio.create_task(self.supervisor.watch_output())]
        try:
            await stop.wait()
        finally:
            log.info("stopping: the training processes stop with the agent (drain the node first to let a "
                     "running job go at a checkpoint)")
            self._notifier.stopping()
            await self.supervisor.shutdown()
            if memory is not None:
                memory.clear()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            progress.close()
            if self._peer_server is not None:
                await asyncio.to_thread(self._peer_server.stop)
            if self._peer_client is not None:
                self._peer_client.close()
            await server.stop(grace=1.0)
            health_socket.unlink(missing_ok=True)


def build_agent(config: AgentConfig, devices: list[Device], notifier: SystemdNotifier,
                tls: TlsFiles | None = None, tls_settings: TlsSettings | None = None) -> Agent:
    """The production wiring: a link to the configured coordinators (over TLS with `tls`, read from the
    files `tls_settings` names, which a renewal replaces), a supervisor that starts real processes (as the
    `run_as` user when there is one) and dumps their stacks with py-spy, and the system clock."""
    work_dir = Path(config.work_dir)
    clock = SystemClock()
    worker_user = None if config.run_as is None else WorkerUser.from_settings(config.run_as)
    memory = MemorySnapshotDir(memory_root(config), worker_user)
    peer_server, peer_client = None, None
    refusal = snapshot_peers_refusal(config, tls)
    if refusal:
        log.warning("serving no in-memory snapshots to other agents: %s; a job spanning hosts resumes "
                    "from disk checkpoints only", refusal)
    else:
        peer_server, peer_client = PeerServer(memory, config.host, tls, config.snapshot_peer_port), PeerClient(tls)
    peer_port = 0
    if peer_server is not None:
        try:
            peer_port = peer_server.start()  # 0: its node certificate cannot serve (it says so)
        except OSError as exc:
            log.warning("serving no in-memory snapshots to other agents: %s", exc)
        if peer_port == 0:
            peer_server = peer_client = None
    hello = pb.Hello(
        node_name=config.node_name, host=config.host, agent_version=AGENT_VERSION,
        devices=[pb.Device(device_id=d.device_id, device_ip=d.device_ip, kind=d.kind) for d in devices],
        peer_port=peer_port,
    )
    link = CoordinatorLink(addresses=list(config.coordinator), hello=hello,
                           identity=IdentityFile(work_dir / "identity.json"), clock=clock,
                           credentials=None if tls is None else tls.channel_credentials())
    launcher = SubprocessLauncher(worker_user)
    training_launcher: ProcessLauncher = WarmLauncher(
        launcher, python=sys.executable, log_path=work_dir / "warm_workers.log", capacity=len(devices) + 1,
        user=worker_user, enabled=config.warm_workers)
    if config.compile_cache:
        training_launcher = CompileCacheLauncher(training_launcher, work_dir / "compile_cache", worker_user)
    supervisor = Supervisor(work_dir=work_dir, progress_socket=work_dir / "progress.sock", report=link.send,
                            launcher=training_launcher, stack_dumper=PySpyDumper(), clock=clock,
                            allowed_entrypoints=config.allowed_entrypoints, worker_user=worker_user,
                            memory=memory, peers=peer_client)
    renewal = None
    if tls is not None and tls_settings is not None:
        renewal = Renewal(tls_settings, config.node_name, link.send,
                          lambda files: link.use_credentials(files.channel_credentials()))
    return Agent(config, link=link, supervisor=supervisor, notifier=notifier, clock=clock, launcher=launcher,
                 peer_server=peer_server, peer_client=peer_client, renewal=renewal)


def snapshot_peers_refusal(config: AgentConfig, tls: TlsFiles | None) -> str:
    """Why this agent cannot serve its snapshot files to the other agents ("" when it can)."""
    if not config.snapshot_peers:
        return "snapshot_peers is off"
    if tls is None and not is_loopback_host(config.host):
        return f"without TLS nothing listens beyond loopback, and this host is {config.host}"
    return ""


def node_certificate_refusal(tls: TlsFiles, node_name: str, where: str) -> str:
    """Why the certificate `where` names cannot open this agent's session ("" when it can): the coordinator
    admits an agent only as the node its certificate names, and would refuse every dial of one that is not."""
    try:
        identity = peer_identity(tls.cert)
    except CertificateError as exc:
        return (f"{where} is not a node certificate of trainerd's ({exc}): make one with `trainerd certs node "
                f"{node_name}`")
    if identity.kind is PeerKind.OPERATOR:
        return (f"{where} is operator {identity.name}'s certificate, not a node's: give this agent node "
                f"{node_name}'s (`trainerd certs node {node_name}`)")
    if identity.name != node_name:
        return (f"{where} is node {identity.name}'s certificate, but this agent is node {node_name}: set node_name "
                f"(--node-name) to {identity.name}, or give it node {node_name}'s certificate")
    return ""


@click.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="Agent file (YAML).")
@click.option("--coordinator", help="Coordinator HOST:PORT (comma-separated for standbys).")
@click.option("--node-name", help="This node's name (default: the host name).")
@click.option("--host", help="Address other nodes reach this host at (default: this host's address on its "
              "route to the first coordinator).")
@click.option("--cpu-devices", type=int, help="Train on N CPU devices (hosts without NPUs).")
@click.option("--work-dir", type=click.Path(file_okay=False), help="Logs, rank tables and state.")
@click.option("--memory-dir", type=click.Path(file_okay=False),
              help="Where the workers' in-memory snapshots go (tmpfs; default /dev/shm/trainerd-agent-HASH).")
@click.option("--cacert", envvar=TLS_ENV["cacert"], metavar="FILE",
              help="The cluster's CA certificate: talk TLS (with --cert and --key; overrides tls in the file).")
@click.option("--cert", envvar=TLS_ENV["cert"], metavar="FILE", help="This node's certificate (trainerd certs node).")
@click.option("--key", envvar=TLS_ENV["key"], metavar="FILE", help="Its key.")
@click.option("--join", "join_token", envvar=JOIN_TOKEN_ENV, metavar="TOKEN",
              help="Join the cluster with this token (trainerctl tokens create): make a key, get this node's "
                   "certificate, keep both (under tls, or WORK_DIR/tls), then start. Skipped when they are kept "
                   "already.")
@click.option("--join-address", metavar="HOST:PORT", help="The coordinator's join listener (cluster.join.listen).")
@click.option("--ca-hash", metavar="sha256:HEX", help="The cluster's CA, pinned: joining trusts no other.")
@click.option("--warm-workers/--no-warm-workers", default=None,
              help="Fork Python entrypoints from interpreters that imported MindSpore once (default: on).")
@click.option("--compile-cache/--no-compile-cache", default=None,
              help="MindSpore's compile cache (default: off; only for jobs whose step is a Cell, as Model.train's).")
@click.option("--snapshot-peers/--no-snapshot-peers", default=None,
              help="Serve in-memory snapshots to the other agents and copy theirs (default: on).")
@click.option("--snapshot-peer-port", type=int, default=None,
              help="The port that serves them, on --host (default: one the kernel picks).")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def cli(config_file, coordinator, node_name, host, cpu_devices, work_dir, memory_dir, cacert, cert, key,
        join_token, join_address, ca_hash, warm_workers, compile_cache, snapshot_peers, snapshot_peer_port,
        log_level) -> None:
    """Register this host's devices with trainerd and run its training processes."""
    try:
        tls_options = tls_settings_from_options(cacert, cert, key)
        config = load_agent_config(config_file, {
            "coordinator": coordinator, "node_name": node_name, "host": host,
            "cpu_devices": cpu_devices, "work_dir": work_dir, "memory_dir": memory_dir,
            "warm_workers": warm_workers, "compile_cache": compile_cache, "snapshot_peers": snapshot_peers,
            "snapshot_peer_port": snapshot_peer_port,
            "tls": None if tls_options is None else tls_options.model_dump(),
        })
        check_join_options(join_token, join_address, ca_hash)
        if tls_options is None and config.tls is None:
            stored = stored_tls(Path(config.work_dir))
            if join_token or has_stored_files(stored):
                config = config.model_copy(update={"tls": stored})
                config_file = config_file or "trainerd-agent"
        if join_token and config.tls is not None and not has_stored_files(config.tls):
            try:
                join(join_address, join_token, config.node_name, check_pin(ca_hash), config.tls)
            except (JoinFailed, ValueError, OSError) as exc:
                raise StartRefused(f"trainerd-agent: {exc}") from exc
            click.echo(f"trainerd-agent: joined as node {config.node_name}; its key and certificate are in "
                       f"{Path(config.tls.cert_file).parent}", err=True)
        tls = None
        tls_settings = tls_options or config.tls
        if tls_options is not None:
            tls = read_tls_files(tls_options, "trainerd-agent", TLS_OPTION_NAMES)
            from_environment = click.get_current_context().get_parameter_source("cert") is ParameterSource.ENVIRONMENT
            where = (f"trainerd-agent: ${TLS_ENV['cert']} ({tls_options.cert_file}; the environment's TLS files "
                     f"override the agent file's)" if from_environment else f"trainerd-agent: --cert {cert}")
        elif config.tls is not None:
            tls = read_tls_files(config.tls, str(config_file), ("tls.ca_file", "tls.cert_file", "tls.key_file"))
            where = f"{config_file}: tls.cert_file {config.tls.cert_file}"
        if tls is not None and (refusal := node_certificate_refusal(tls, config.node_name, where)):
            raise StartRefused(refusal)
        devices = discover_devices(cpu_devices=config.cpu_devices,
                                   dev_dir=Path(config.discovery.dev_dir),
                                   hccn_conf=Path(config.discovery.hccn_conf))
    except (ConfigError, NoDevicesError) as exc:
        raise StartRefused(str(exc)) from exc
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(asctime)s %(levelname)s agent {config.node_name}: %(message)s")
    for noisy in ("grpc", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await build_agent(config, devices, SystemdNotifier(), tls, tls_settings).run(stop)

    try:
        asyncio.run(serve())
    except OSError as exc:
        click.echo(f"trainerd-agent: {exc}", err=True)
        sys.exit(1)


def main() -> None:
    cli(prog_name="trainerd-agent")


if __name__ == "__main__":
    main()
