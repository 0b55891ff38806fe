"""`ClusterBox`: a whole trainerd deployment on this machine, run as a real one would be, with its faults.

- N hosts h0, h1, ..., each a network namespace with its own address on a bridge (network.py) and its
  own trainerd-agent (`--host` its address, its own work dir, a node certificate of the cluster's CA).
  Each agent reaches each coordinator through a TcpRelay in its namespace (relay.py), so its traffic
  can be dropped, delayed or stalled on command.
- A 3-member etcd cluster on 127.0.0.1 (etcd_cluster.py).
- Two coordinators (`trainerd start --cluster`) listening on the bridge's address over mutual TLS, with
  certificates from `trainerd certs`; the test talks to them with an operator certificate.
- The checkpoint directory is a small tmpfs, so the disk can be filled.
- With `join=True` no node file is made or copied: the coordinators serve cluster.join, and each agent joins
  with the command line a join token comes with (docs/cluster/joining.md), then starts from what it kept.

Use it as a context manager (tests/integration/test_chaos.py has the fixture): `close` kills every
process, unmounts the tmpfs and removes every namespace, link and the bridge even when the test failed,
and opening one first sweeps what an earlier run that was killed left behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
import yaml

from common.tls_files import TlsFiles
from proto import trainerd_pb2 as pb
from proto import trainerd_pb2_grpc as pb_grpc
from tests.cluster_box.etcd_cluster import EtcdCluster
from tests.cluster_box.network import NetHost, Network, kill_namespace_processes, sweep_leftovers
from tests.cluster_box.relay import TcpRelay
from tests.harness import BIN, Proc, Processes
from tests.ports import free_port
from tests.waiting import wait_until

OPERATOR = "operator"


@dataclass
class BoxHost:
    name: str
    net: NetHost
    work_dir: Path
    relays: list[TcpRelay] = field(default_factory=list)
    agent: Proc | None = None

    @property
    def address(self) -> str:
        return self.net.address

    def processes(self) -> list[psutil.Process]:
        """What the agent started for a job (scheduler and workers, and their children), alive now: not
        its warm templates (`python -m agent.warm_worker`; the children they fork show their job's command)."""
        if self.agent is None or not self.agent.alive():
            return []
        found = []
        try:
            children = psutil.Process(self.agent.pid).children(recursive=True)
        except psutil.Error:
            return []
        for proc in children:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE and "agent.warm_worker" not in proc.cmdline():
                    found.append(proc)
            except psutil.Error:
                continue
        return found

    def workers(self) -> list[psutil.Process]:
        """The training processes (MS_ROLE MS_WORKER; the MindSpore scheduler's is MS_SCHED)."""
        found = []
        for proc in self.processes():
            try:
                if proc.environ().get("MS_ROLE") == "MS_WORKER":
                    found.append(proc)
            except psutil.Error:
                continue
        return found

    # Traffic between this host's agent and the coordinators, on every relay at once.
    def drop(self) -> None:
        for relay in self.relays:
            relay.drop()

    def delay(self, seconds: float) -> None:
        for relay in self.relays:
            relay.delay(seconds)

    def stall(self, seconds: float) -> None:
        for relay in self.relays:
            relay.stall(seconds)

    def pass_through(self) -> None:
        for relay in self.relays:
            relay.pass_through()


@dataclass
class BoxCoordinator:
    name: str
    address: str
    proc: Proc


class ClusterBox:
    """`job` builds the cluster file's job from the box (for its `checkpoint_dir`); None runs no job.
    `warm_workers`: the agents' (on, as in the product: tests/harness.py `Processes.agent` says why)."""

    def __init__(self, tmp_path: Path, *, hosts: int = 3, job: Callable[[ClusterBox], dict] | None = None,
                 heartbeat_interval_s: float = 0.5, heartbeat_timeout_s: float = 2.0,
                 checkpoint_fs_mb: int = 64, join: bool = False, warm_workers: bool = True) -> None:
        self.network = Network()
        self.root = tmp_path / self.network.tag  # every process's command line names the owner's tag
        self.checkpoint_dir = self.root / "checkpoints"
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._host_count = hosts
        self._job = job
        self._checkpoint_fs_mb = checkpoint_fs_mb
        self._join = join
        self._warm_workers = warm_workers
        self.join_flags: list[str] = []  # what `trainerctl tokens create` printed, without --node-name
        self.procs = Processes(self.root)
        self.hosts: list[BoxHost] = []
        self.coordinators: list[BoxCoordinator] = []
        self.etcd: EtcdCluster | None = None
        self._mounted = False
        self._channels: dict[str, grpc.Channel] = {}
        self._pki = self.root / "pki"
        # The agents' in-memory snapshots (tmpfs, as in production), removed with the box: an agent killed
        # with SIGKILL cannot remove its own.
        self.memory_root = Path("/dev/shm") / self.network.tag

    # ------------------------------------------------------------ life

    def __enter__(self) -> ClusterBox:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        sweep_leftovers()
        self.root.mkdir(parents=True)
        self.network.open()
        self._make_pki()
        self.checkpoint_dir.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self._checkpoint_fs_mb}m",
                        f"{self.network.tag}-ckpt", str(self.checkpoint_dir)], check=True, timeout=30)
        self._mounted = True
        self.etcd = EtcdCluster(self.root, self.procs, token=self.network.tag).start()
        job = None if self._job is None else self._job(self)
        for index in range(2):
            self._start_coordinator(f"c{index}", job)
        wait_until(self.leader, 60, "a leading coordinator", on_timeout=self.procs.logs)
        if self._join:
            self.join_flags = self.create_token(uses=self._host_count)
        for _ in range(self._host_count):
            self._add_host()

    def close(self) -> None:
        """Everything this box made goes, whatever state it is in; safe to call more than once."""
        for host in self.hosts:
            for relay in host.relays:
                relay.close()
        # Agents and workers first (what runs in the namespaces), then the namespaces, links and bridge.
        self.network.close()
        # No graceful stop to wait for (etcd hands its leadership over first): the box goes as a whole.
        for proc in [c.proc for c in self.coordinators] + ([] if self.etcd is None else self.etcd.procs()):
            proc.kill_group()
        self.procs.cleanup()
        for channel in self._channels.values():
            channel.close()
        self._channels = {}
        if self._mounted:
            subprocess.run(["umount", "-l", str(self.checkpoint_dir)], capture_output=True, timeout=30)
            self._mounted = False
        shutil.rmtree(self.memory_root, ignore_errors=True)

    # ------------------------------------------------------------ parts

    def _certs(self, *argv: str) -> None:
        result = subprocess.run([str(BIN / "trainerd"), "certs", *argv, "--dir", str(self._pki)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr

    def _make_pki(self) -> None:
        self._certs("init", "--host", self.network.gateway)
        self._certs("operator", OPERATOR)
        self._operator = TlsFiles(*(self._pki.joinpath(n).read_bytes()
                                    for n in ("ca.crt", f"{OPERATOR}.crt", f"{OPERATOR}.key")))

    def _start_coordinator(self, name: str, job: dict | None) -> None:
        assert self.etcd is not None
        address = f"{self.network.gateway}:{free_port()}"
        cluster = {
            "name": self.network.tag,
            "coordinator": {"listen": address, "leader_lease_s": 2},
            "etcd": {"endpoints": self.etcd.endpoints, "data_dir": str(self.root / f"{name}-etcd")},
            "heartbeat": {"interval_s": self.heartbeat_interval_s, "timeout_s": self.heartbeat_timeout_s},
            "local_agents": 0,
            "tls": {"ca_file": str(self._pki / "ca.crt"), "cert_file": str(self._pki / "coordinator.crt"),
                    "key_file": str(self._pki / "coordinator.key")},
        }
        if self._join:
            cluster["join"] = {"listen": f"{self.network.gateway}:{free_port()}",
                               "ca_key_file": str(self._pki / "ca.key")}
        path = self.root / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"cluster": cluster, **({} if job is None else {"job": job})}))
        self.coordinators.append(BoxCoordinator(name, address, self.procs.trainerd(name, path)))

    def _add_host(self) -> BoxHost:
        net = self.network.add_host()
        name = f"h{len(self.hosts)}"
        host = BoxHost(name, net, self.root / "agents" / name)
        self.hosts.append(host)
        if not self._join:
            self._certs("node", name)
        for coordinator in self.coordinators:
            gateway, port = coordinator.address.rsplit(":", 1)
            host.relays.append(TcpRelay((gateway, int(port)), netns=net.namespace).start())
        self.start_agent(host)
        wait_until(lambda: self.node_states().get(name) == "READY", 60, f"{name} READY",
                   on_timeout=self.procs.logs)
        return host

    def start_agent(self, host: BoxHost) -> Proc:
        """Start (or start again) the host's agent in its namespace, dialling the coordinators through
        its relays."""
        env = {"TRAINERD_CACERT": str(self._pki / "ca.crt"), "TRAINERD_CERT": str(self._pki / f"{host.name}.crt"),
               "TRAINERD_KEY": str(self._pki / f"{host.name}.key")}
        join: list[str] = []
        if self._join:  # the token's command line, the coordinators through the relays; later starts the same
            env = {}
            at = self.join_flags.index("--coordinator")
            join = self.join_flags[:at] + self.join_flags[at + 2:]
        host.agent = self.procs.start(host.name, [
            "ip", "netns", "exec", host.net.namespace, str(BIN / "trainerd-agent"),
            "--coordinator", ",".join(r.address for r in host.relays), "--node-name", host.name,
            "--host", host.address, "--cpu-devices", "1", "--work-dir", str(host.work_dir),
            "--memory-dir", str(self.memory_root / host.name), "--log-level", "DEBUG",
            "--compile-cache",  # the jobs here step a Cell (the examples' Model.train and TrainStep)
            *([] if self._warm_workers else ["--no-warm-workers"]), *join,
        ], env)
        return host.agent

    def create_token(self, uses: int) -> list[str]:
        """A join token, as `trainerctl tokens create` prints its command: the flags of trainerd-agent."""
        leader = self.leader()
        assert leader is not None
        reply = self._control(leader).CreateToken(pb.CreateTokenRequest(ttl_s=600, uses=uses), timeout=10)
        return ["--join", reply.token, "--join-address", reply.join_address,
                "--coordinator", ",".join(reply.coordinators), "--ca-hash", reply.ca_pin]

    def revoke(self, host: BoxHost) -> str:
        leader = self.leader()
        assert leader is not None
        return self._control(leader).RevokeNode(pb.RevokeNodeRequest(node=host.name), timeout=10).message

    # ------------------------------------------------------------ looking

    def _control(self, coordinator: BoxCoordinator) -> pb_grpc.ControlStub:
        channel = self._channels.get(coordinator.address)
        if channel is None:
            channel = self._channels[coordinator.address] = grpc.secure_channel(
                coordinator.address, self._operator.channel_credentials())
        return pb_grpc.ControlStub(channel)

    def leader(self) -> BoxCoordinator | None:
        for coordinator in self.coordinators:
            if not coordinator.proc.alive():
                continue
            try:
                reply = self._control(coordinator).GetStatus(pb.StatusRequest(), timeout=2)
            except grpc.RpcError:
                continue
            if reply.coordinator.is_leader:
                return coordinator
        return None

    def status(self) -> pb.StatusReply | None:
        """The leader's status, or None while no coordinator leads."""
        leader = self.leader()
        if leader is None:
            return None
        try:
            return self._control(leader).GetStatus(pb.StatusRequest(), timeout=2)
        except grpc.RpcError:
            return None

    def node_states(self) -> dict[str, str]:
        reply = self.status()
        return {} if reply is None else {n.name: n.state for n in reply.nodes}

    def job(self) -> pb.JobStatus | None:
        reply = self.status()
        return reply.job if reply is not None and reply.HasField("job") else None

    def events(self) -> list[pb.Event]:
        leader = self.leader()
        assert leader is not None, "no coordinator leads"
        found: list[pb.Event] = []
        while True:
            page = self._control(leader).ListEvents(pb.EventsRequest(after_seq=found[-1].seq if found else 0),
                                                    timeout=5).events
            found += page
            if len(page) < 500:
                return found

    def host(self, name: str) -> BoxHost:
        return next(h for h in self.hosts if h.name == name)

    # ------------------------------------------------------------ faults

    def cut(self, host: BoxHost) -> None:
        """Take the host's link down: nothing in or out, and no connection is reset."""
        self.network.cut(host.net)

    def heal(self, host: BoxHost) -> None:
        self.network.heal(host.net)

    def kill_host(self, host: BoxHost) -> None:
        """The host dies (power lost): its link goes down first, so no connection is reset, then its agent
        and everything it started are killed and its shared memory is gone. `heal` and `start_agent`
        bring it back empty, as a rebooted host."""
        self.network.cut(host.net)
        kill_namespace_processes(host.net.namespace)
        if host.agent is not None:
            host.agent.kill_group()
        shutil.rmtree(self.memory_root / host.name, ignore_errors=True)

    def throttle(self, host: BoxHost, rate_kbit: int) -> None:
        """All the host's traffic, MindSpore's between the hosts too, through a token bucket of `rate_kbit`
        that drops what overflows its queue (`Network.throttle`)."""
        self.network.throttle(host.net, rate_kbit)

    def unthrottle(self, host: BoxHost) -> None:
        self.network.unthrottle(host.net)

    def bytes_carried(self, host: BoxHost) -> int:
        return self.network.bytes_carried(host.net)

    def kill_coordinator(self, coordinator: BoxCoordinator) -> None:
        coordinator.proc.kill_group()

    def restart_coordinator(self, coordinator: BoxCoordinator) -> None:
        """Start a killed coordinator again on its address, from its cluster file (it comes back a standby
        while the other leads)."""
        coordinator.proc = self.procs.trainerd(coordinator.name, self.root / f"{coordinator.name}.yaml")

    def freeze_coordinator(self, coordinator: BoxCoordinator) -> None:
        os.kill(coordinator.proc.pid, signal.SIGSTOP)

    def thaw_coordinator(self, coordinator: BoxCoordinator) -> None:
        os.kill(coordinator.proc.pid, signal.SIGCONT)

    def kill_worker(self, worker: psutil.Process) -> None:
        worker.send_signal(signal.SIGKILL)

    def freeze_worker(self, worker: psutil.Process) -> None:
        """SIGSTOP: alive, holding its sockets, doing nothing (the kernel shows it as stopped)."""
        worker.send_signal(signal.SIGSTOP)

    def thaw_worker(self, worker: psutil.Process) -> None:
        worker.send_signal(signal.SIGCONT)

    def fill_checkpoint_fs(self) -> None:
        """Fill the checkpoint tmpfs to the last byte (free_checkpoint_fs gives the space back)."""
        with open(self.checkpoint_dir / ".filler", "ab", buffering=0) as filler:
            for size in (1 << 20, 4096):  # then the last partial megabyte
                try:
                    while True:
                        filler.write(b"\0" * size)
                except OSError:
                    pass

    def free_checkpoint_fs(self) -> None:
        (self.checkpoint_dir / ".filler").unlink(missing_ok=True)
