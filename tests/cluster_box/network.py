"""Hosts in network namespaces on one bridge, with addresses in 198.18.0.0/15 (the benchmarking range,
which only ever appears inside what this module makes).

Every name carries the owning process's id: `tbx<pid hex><n>` for the bridge (`...br`), the
host-side veths (`...v<i>`) and the namespaces (`...-h<i>`). `sweep_leftovers` removes what a
process that no longer runs left behind (a test run killed before its cleanup), so runs never collide
and never pile up.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil

PREFIX = "tbx"
BENCHMARK_RANGE = ipaddress.ip_network("198.18.0.0/15")
_OWNER = re.compile(rf"^{PREFIX}([0-9a-f]{{6}})")
_OWNED_PATH = re.compile(rf"/({PREFIX}[0-9a-f]{{6}})")
_instances = itertools.count()


class NetworkError(RuntimeError):
    """An `ip` command failed (the fixture needs root and iproute2)."""


def ip(*argv: str, check: bool = True) -> str:
    result = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NetworkError(f"ip {' '.join(argv)}: {result.stderr.strip()}")
    return result.stdout


def _owner_alive(name: str) -> bool:
    match = _OWNER.match(name)
    if match is None:
        return True  # not ours
    try:
        os.kill(int(match.group(1), 16), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _link_ends(host: NetHost) -> list[tuple[tuple[str, ...], str]]:
    """The host's veth at both ends (the bridge's side, then the host's eth0), with the command prefix that
    reaches each: egress shaping on both shapes both directions."""
    return [((), host.link), (("ip", "netns", "exec", host.namespace), "eth0")]


def _tc(prefix: tuple[str, ...], *argv: str, check: bool = True) -> None:
    result = subprocess.run([*prefix, "tc", *argv], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NetworkError(f"tc {' '.join(argv)}: {result.stderr.strip()}")


def kill_namespace_processes(namespace: str) -> None:
    for pid in ip("netns", "pids", namespace, check=False).split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def sweep_leftovers() -> list[str]:
    """Remove processes, tmpfs mounts, namespaces and links whose owning process is gone (a run killed
    before its cleanup: its root-namespace processes name its directory `.../tbx<pid>...`); returns
    what it removed."""
    swept = []
    for proc in psutil.process_iter(["cmdline"]):
        owned = _OWNED_PATH.search(" ".join(proc.info["cmdline"] or []))
        if owned and not _owner_alive(owned.group(1)):
            try:
                proc.kill()
                swept.append(f"pid {proc.pid}")
            except psutil.Error:
                pass
    with open("/proc/mounts") as mounts:
        for line in mounts:
            source, target = line.split()[:2]
            if source.startswith(PREFIX) and not _owner_alive(source):
                subprocess.run(["umount", "-l", target], capture_output=True, timeout=30)
                swept.append(target)
    for line in ip("netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(PREFIX) and not _owner_alive(name):
            kill_namespace_processes(name)
            ip("netns", "del", name, check=False)
            swept.append(name)
    for line in ip("-o", "link", "show").splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(PREFIX) and not _owner_alive(name):
            ip("link", "del", name, check=False)
            swept.append(name)
    return swept


def _free_subnet(tag: int) -> ipaddress.IPv4Network:
    """A /24 of the benchmarking range that no interface of this machine uses yet."""
    used = ip("-4", "-o", "addr", "show")
    subnets = list(BENCHMARK_RANGE.subnets(new_prefix=24))
    for offset in range(len(subnets)):
        subnet = subnets[(tag + offset) % len(subnets)]
        if f" {subnet.network_address.exploded.rsplit('.', 1)[0]}." not in used:
            return subnet  # type: ignore[return-value]
    raise NetworkError("every /24 of 198.18.0.0/15 is in use on this machine")


@dataclass(frozen=True)
class NetHost:
    """One host: its namespace, its address on the bridge, and the veth end outside it."""

    namespace: str
    address: str
    link: str


class Network:
    """A bridge in the root namespace (it holds the subnet's .1, where the coordinators listen) and
    hosts added one by one. `close` removes all of it; it is safe to call more than once."""

    def __init__(self) -> None:
        self.tag = f"{PREFIX}{os.getpid():06x}{next(_instances):x}"
        self.subnet = _free_subnet(os.getpid() * 7 + int(self.tag[-1], 16))
        self.gateway = str(self.subnet.network_address + 1)
        self.bridge = f"{self.tag}br"
        self.hosts: list[NetHost] = []
        self._made_bridge = False

    def open(self) -> Network:
        ip("link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        return self

    def add_host(self) -> NetHost:
        index = len(self.hosts)
        host = NetHost(f"{self.tag}-h{index}", str(self.subnet.network_address + 10 + index), f"{self.tag}v{index}")
        self.hosts.append(host)
        ip("netns", "add", host.namespace)
        ip("link", "add", host.link, "type", "veth", "peer", "name", f"{self.tag}p{index}")
        ip("link", "set", f"{self.tag}p{index}", "netns", host.namespace)
        ip("link", "set", host.link, "master", self.bridge)
        ip("link", "set", host.link, "up")
        inside = ("netns", "exec", host.namespace, "ip")
        ip(*inside, "link", "set", "lo", "up")
        ip(*inside, "link", "set", f"{self.tag}p{index}", "name", "eth0")
        ip(*inside, "addr", "add", f"{host.address}/24", "dev", "eth0")
        ip(*inside, "link", "set", "eth0", "up")
        ip(*inside, "route", "add", "default", "via", self.gateway)
        return host

    def cut(self, host: NetHost) -> None:
        """The host's link goes down: no packet in or out, and no connection is reset."""
        ip("link", "set", host.link, "down")

    def heal(self, host: NetHost) -> None:
        ip("link", "set", host.link, "up")

    def throttle(self, host: NetHost, rate_kbit: int, queue_ms: int = 50) -> None:
        """Every packet in and out of the host, trainerd's and MindSpore's alike, goes through a token bucket
        of `rate_kbit` whose queue holds `queue_ms` of traffic: beyond it packets are dropped, so TCP between
        the hosts slows and retransmits, as on a congested or lossy link. (This kernel has no netem; tbf it has.)"""
        for prefix, link in _link_ends(host):
            _tc(prefix, "qdisc", "replace", "dev", link, "root", "tbf", "rate", f"{rate_kbit}kbit", "burst",
                "16kb", "latency", f"{queue_ms}ms")

    def bytes_carried(self, host: NetHost) -> int:
        """Bytes through the host's link so far, both ways (the bridge side's counters)."""
        statistics = Path("/sys/class/net") / host.link / "statistics"
        return sum(int((statistics / name).read_text()) for name in ("rx_bytes", "tx_bytes"))

    def unthrottle(self, host: NetHost) -> None:
        for prefix, link in _link_ends(host):
            _tc(prefix, "qdisc", "del", "dev", link, "root", check=False)

    def close(self) -> None:
        for host in self.hosts:
            kill_namespace_processes(host.namespace)
            ip("netns", "del", host.namespace, check=False)
            ip("link", "del", host.link, check=False)
        self.hosts = []
        if self._made_bridge:
            ip("link", "del", self.bridge, check=False)
            self._made_bridge = False
