"""A 3-member etcd cluster on 127.0.0.1 from the installed etcd binary (daemon/etcd_process.py finds it),
with the faults a real one suffers: a member killed and restarted, and the leader moved or killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from daemon.etcd_process import find_etcd_binary
from tests.harness import Proc, Processes
from tests.ports import free_port
from tests.waiting import wait_until


class EtcdMember:
    def __init__(self, name: str, data_dir: Path, client_port: int, peer_port: int) -> None:
        self.name = name
        self.data_dir = data_dir
        self.client_url = f"http://127.0.0.1:{client_port}"
        self.peer_url = f"http://127.0.0.1:{peer_port}"
        self.endpoint = f"127.0.0.1:{client_port}"
        self.proc: Proc | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()


class EtcdCluster:
    """Members e0..e2; `endpoints` is what the coordinators are given."""

    def __init__(self, root: Path, procs: Processes, token: str, size: int = 3) -> None:
        self._procs = procs
        self._token = token
        self._binary = find_etcd_binary()
        self._etcdctl = str(Path(self._binary).with_name("etcdctl"))
        self.members = [EtcdMember(f"e{i}", root / f"etcd-e{i}", free_port(), free_port()) for i in range(size)]

    def procs(self) -> list[Proc]:
        return [m.proc for m in self.members if m.proc is not None]

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def start(self) -> EtcdCluster:
        for member in self.members:
            self._start(member)
        wait_until(self.leader, 30, "an etcd leader")
        return self

    def _start(self, member: EtcdMember) -> None:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        member.proc = self._procs.start(f"etcd-{member.name}", [
            self._binary, "--name", member.name, "--data-dir", str(member.data_dir),
            "--listen-client-urls", member.client_url, "--advertise-client-urls", member.client_url,
            "--listen-peer-urls", member.peer_url, "--initial-advertise-peer-urls", member.peer_url,
            "--initial-cluster", initial, "--initial-cluster-state", "new",
            "--initial-cluster-token", self._token,
            "--heartbeat-interval", "50", "--election-timeout", "500",
        ])

    def kill(self, member: EtcdMember) -> None:
        assert member.proc is not None
        member.proc.kill_group()

    def restart(self, member: EtcdMember) -> None:
        """Start a killed member again on its data directory: it rejoins the cluster."""
        assert not member.alive, f"{member.name} is running"
        self._start(member)

    def freeze(self, member: EtcdMember) -> None:
        assert member.proc is not None
        os.kill(member.proc.pid, signal.SIGSTOP)

    def thaw(self, member: EtcdMember) -> None:
        assert member.proc is not None
        os.kill(member.proc.pid, signal.SIGCONT)

    def _statuses(self) -> list[dict]:
        live = [m.endpoint for m in self.members if m.alive]
        result = subprocess.run([self._etcdctl, "--endpoints", ",".join(live), "--command-timeout", "2s",
                                 "endpoint", "status", "-w", "json"], capture_output=True, text=True, timeout=30)
        return json.loads(result.stdout) if result.returncode == 0 and result.stdout.strip() else []

    def leader(self) -> EtcdMember | None:
        """The member the live members agree leads, or None during an election."""
        statuses = self._statuses()
        leaders = {s["Status"].get("leader", 0) for s in statuses}  # JSON leaves out a zero (no leader yet)
        if len(leaders) != 1 or 0 in leaders:
            return None
        (leader_id,) = leaders
        for status in statuses:
            if status["Status"].get("header", {}).get("member_id") == leader_id:
                return next(m for m in self.members if m.endpoint in status["Endpoint"])
        return None

    def move_leader(self) -> EtcdMember:
        """Hand leadership to another live member (etcdctl move-leader); returns the new leader."""
        leader = wait_until(self.leader, 30, "an etcd leader")
        ids = {m: s["Status"]["header"]["member_id"] for s in self._statuses()
               for m in self.members if m.endpoint in s["Endpoint"]}
        target = next(m for m in ids if m is not leader)
        result = subprocess.run([self._etcdctl, "--endpoints", leader.endpoint, "move-leader", f"{ids[target]:x}"],
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        wait_until(lambda: self.leader() is target, 30, f"etcd leadership on {target.name}")
        return target
