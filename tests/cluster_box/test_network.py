"""The namespaces and links of the cluster box, with real `ip` commands (root): hosts reach each other
and the bridge, a cut host reaches nothing, and nothing is left behind by `close` or, for a process
that died before its cleanup, by the next `sweep_leftovers`."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

from tests.cluster_box.network import PREFIX, Network, ip, sweep_leftovers

CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1)"


def reaches(namespace: str, address: str, port: int) -> bool:
    return subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", CONNECT, address, str(port)],
                          capture_output=True, timeout=30).returncode == 0


def ours(tag: str) -> list[str]:
    names = ip("netns", "list") + ip("-o", "link", "show")
    return [line for line in names.splitlines() if tag in line]


def test_hosts_reach_the_bridge_until_cut_and_close_removes_everything() -> None:
    network = Network().open()
    try:
        first, second = network.add_host(), network.add_host()
        assert first.address != second.address and first.address.startswith("198.1")
        with socket.create_server((network.gateway, 0)) as server:
            port = server.getsockname()[1]
            assert reaches(first.namespace, network.gateway, port)
            network.cut(first)
            assert not reaches(first.namespace, network.gateway, port)
            assert reaches(second.namespace, network.gateway, port)
            network.heal(first)
            assert reaches(first.namespace, network.gateway, port)
    finally:
        network.close()
    assert ours(network.tag) == []


def test_the_sweep_removes_what_a_dead_process_left_and_nothing_of_a_live_one() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = f"{PREFIX}{dead.pid:06x}0"
    ip("netns", "add", f"{leftover}-h0")
    ip("link", "add", f"{leftover}br", "type", "bridge")
    live = Network().open()
    try:
        swept = sweep_leftovers()
        assert f"{leftover}-h0" in swept and f"{leftover}br" in swept
        assert ours(leftover) == []
        assert ours(live.bridge)  # its owner, this process, runs
    finally:
        live.close()
        ip("netns", "del", f"{leftover}-h0", check=False)
        ip("link", "del", f"{leftover}br", check=False)


SEND = """import socket, sys, time
started = time.monotonic()
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60) as conn:
    conn.sendall(bytes(int(sys.argv[3])))
    conn.shutdown(socket.SHUT_WR)
    assert conn.recv(1) == b"k"
print(time.monotonic() - started)"""


def send_seconds(namespace: str, address: str, port: int, size: int) -> float:
    """Seconds to carry `size` bytes from the namespace to address:port and have them acknowledged."""
    sent = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", SEND, address, str(port), str(size)],
                          capture_output=True, text=True, timeout=120, check=True)
    return float(sent.stdout)


def test_a_throttled_host_carries_no_more_than_its_rate_until_unthrottled() -> None:
    network = Network().open()
    try:
        host = network.add_host()
        with socket.create_server((network.gateway, 0)) as server:
            port = server.getsockname()[1]

            def receive() -> None:
                for _ in range(2):
                    conn, _ = server.accept()
                    with conn:
                        while conn.recv(1 << 16):
                            pass
                        conn.sendall(b"k")

            receiver = threading.Thread(target=receive, daemon=True)
            receiver.start()
            size = 400_000  # bytes: at 800 kbit/s (100 kB/s) at least 3.8 s beyond the bucket's 16 kB
            network.throttle(host, rate_kbit=800)
            throttled = send_seconds(host.namespace, network.gateway, port, size)
            network.unthrottle(host)
            free = send_seconds(host.namespace, network.gateway, port, size)
            receiver.join(timeout=30)
        print(f"{size} bytes: {throttled:.2f} s throttled, {free:.3f} s after")
        assert throttled >= (size - 16_384) / 100_000 * 0.95, throttled
        assert free < throttled / 2, (free, throttled)
    finally:
        network.close()
    assert ours(network.tag) == []
