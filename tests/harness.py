"""Real processes for the integration tests: trainerd, agents and trainerctl, each with a log file,
its own process group and a hard kill at teardown."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.tls_files import TlsSettings, read_tls_files
from daemon.cli.status_json import event_to_json, status_to_json
from daemon.cli.trainerctl import Coordinators, call_control, fetch_status
from daemon.events import EVENTS_PAGE
from proto import trainerd_pb2 as pb

BIN = Path(sys.executable).parent


class Proc:
    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.popen = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env={**os.environ, **(env or {})},
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():
            self.popen.send_signal(signum)

    def kill_group(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(timeout=10)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class Processes:
    """Every process a test starts; all of them are killed (whole groups) at teardown."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._all: list[Proc] = []
        # The agents' in-memory snapshots: on tmpfs, one directory per agent, removed at teardown.
        self.memory_root = Path("/dev/shm") / f"trainerd-test-{hashlib.sha256(str(root).encode()).hexdigest()[:12]}"

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(argv, self.root / "logs" / f"{name}.log", env)
        self._all.append(proc)
        return proc

    def by_name(self, name: str) -> Proc:
        """The newest process started under `name`."""
        return next(p for p in reversed(self._all) if p.log_path.stem == name)

    def trainerd(self, name: str, cluster_file: Path) -> Proc:
        return self.start(name, [str(BIN / "trainerd"), "start", "--cluster", str(cluster_file),
                                 "--log-level", "DEBUG"])

    def agent(self, node_name: str, coordinator: str, cpu_devices: int = 1,
              env: dict[str, str] | None = None, flags: tuple[str, ...] = (), warm_workers: bool = True) -> Proc:
        """`warm_workers`: on, as in the product: every process of a job forked from one template per device
        (agent/warm_launcher.py), which imported MindSpore once for all generations; a process started
        cold imports it again (about 2 CPU-seconds each, the largest part of this suite's CPU time)."""
        return self.start(node_name, [
            str(BIN / "trainerd-agent"), "--coordinator", coordinator, "--node-name", node_name,
            "--cpu-devices", str(cpu_devices), "--work-dir", str(self.root / "agents" / node_name),
            "--memory-dir", str(self.memory_root / node_name), "--log-level", "DEBUG",
            *([] if warm_workers else ["--no-warm-workers"]), *flags,
        ], env)

    def cleanup(self) -> None:
        """SIGTERM first (trainerd then stops its agents and etcd), SIGKILL after a grace, and finally
        kill anything still running from this test's directory (agents, workers, etcd in their own
        process groups), so no test leaves load behind for the next one."""
        for proc in reversed(self._all):
            proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in reversed(self._all):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            proc.kill_group()
        for leftover in processes_mentioning(self.root):
            try:
                os.killpg(leftover.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                leftover.kill()
        shutil.rmtree(self.memory_root, ignore_errors=True)

    def logs(self) -> str:
        return "\n".join(f"===== {p.log_path.name}\n{p.log()[-4000:]}" for p in self._all)


def processes_mentioning(path: Path) -> list[psutil.Process]:
    """Live processes whose command line mentions `path`."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if str(path) in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def health(target: str, service: str = "") -> str:
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5)
        except grpc.RpcError as exc:
            return exc.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def trainerctl(*args: str, coordinator: str | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    argv = [str(BIN / "trainerctl")]
    if coordinator:
        argv += ["--coordinator", coordinator]
    return subprocess.run(argv + list(args), capture_output=True, text=True, timeout=timeout)


def _coordinators(coordinator: str, tls: TlsSettings | None = None) -> Coordinators:
    return Coordinators([a.strip() for a in coordinator.split(",") if a.strip()],
                        None if tls is None else read_tls_files(tls, "test"))


def status(coordinator: str, tls: TlsSettings | None = None) -> dict | None:
    """What `trainerctl status -o json` prints, or None while no coordinator can answer.

    Asked in-process, through the CLI's own fetch (which follows a standby to the leader) and rendering:
    a `trainerctl` process per poll costs ~0.8 CPU-seconds, which the training under test needs. The tests
    that check the command itself still run it. `tls`: the operator's CA, certificate and key."""
    try:
        _, reply = fetch_status(_coordinators(coordinator, tls))
    except click.ClickException:
        return None
    return status_to_json(reply)


def events(coordinator: str) -> list[dict]:
    """Every event, oldest first, as `trainerctl events -o json` prints them (in-process, like `status`)."""
    found: list[dict] = []
    while True:
        reply = call_control(_coordinators(coordinator), "ListEvents",
                             pb.EventsRequest(after_seq=found[-1]["seq"] if found else 0, limit=EVENTS_PAGE))
        found += [event_to_json(event) for event in reply.events]
        if len(reply.events) < EVENTS_PAGE:
            return found


def node_states(coordinator: str) -> dict[str, str]:
    data = status(coordinator)
    return {} if data is None else {n["name"]: n["state"] for n in data["nodes"]}
