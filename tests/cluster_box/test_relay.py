"""The relay with plain sockets on 127.0.0.1: an echo server behind it, a client in front of it."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from tests.cluster_box.relay import TcpRelay


class Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(4096):
            self.request.sendall(data)


@pytest.fixture
def relay() -> Iterator[TcpRelay]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    with TcpRelay(("127.0.0.1", server.server_address[1])) as started:
        yield started
    server.shutdown()
    server.server_close()


def round_trip(client: socket.socket, payload: bytes, timeout: float = 5.0) -> float:
    """Seconds until `payload` came back through the relay."""
    client.settimeout(timeout)
    start = time.monotonic()
    client.sendall(payload)
    received = b""
    while len(received) < len(payload):
        received += client.recv(4096)
    assert received == payload
    return time.monotonic() - start


def connect(relay: TcpRelay) -> socket.socket:
    return socket.create_connection(("127.0.0.1", relay.port), timeout=5)


def test_passes_bytes_both_ways(relay: TcpRelay) -> None:
    with connect(relay) as client:
        assert round_trip(client, b"x" * 100_000) < 1.0


def test_delay_holds_each_chunk_in_both_directions(relay: TcpRelay) -> None:
    with connect(relay) as client:
        relay.delay(0.3)
        assert 0.6 <= round_trip(client, b"ping") < 1.5  # 0.3 s out, 0.3 s back
        relay.pass_through()
        assert round_trip(client, b"ping") < 0.3


def test_stall_delivers_nothing_until_it_is_over_then_everything(relay: TcpRelay) -> None:
    with connect(relay) as client:
        relay.stall(1.0)
        assert 0.9 <= round_trip(client, b"a" * 50_000) < 2.0
        assert round_trip(client, b"after") < 0.3


def test_drop_is_a_black_hole_that_closes_the_connections_it_damaged_when_it_ends(relay: TcpRelay) -> None:
    with connect(relay) as damaged, connect(relay) as idle:
        relay.drop()
        damaged.sendall(b"lost")
        damaged.settimeout(0.5)
        with pytest.raises(socket.timeout):
            damaged.recv(10)  # the connection is open, and nothing comes back
        relay.pass_through()
        damaged.settimeout(5)
        assert damaged.recv(10) == b""  # closed: a stream with a hole in it cannot go on
        assert round_trip(idle, b"found") < 0.5  # it lost nothing: it goes on
        with connect(relay) as fresh:
            assert round_trip(fresh, b"again") < 0.5
