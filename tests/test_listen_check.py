"""Whether an address can be listened on, asked before gRPC (common/listen_check.py), with real sockets."""

from __future__ import annotations

import socket

import psutil

from common.listen_check import why_cannot_listen
from tests.ports import free_port


def test_a_free_port_can_be_listened_on_and_a_taken_one_says_why() -> None:
    port = free_port()
    assert why_cannot_listen(f"127.0.0.1:{port}") is None
    with socket.create_server(("127.0.0.1", port)):
        assert why_cannot_listen(f"127.0.0.1:{port}") == (
            "the address is in use (another trainerd, or another program, listens on it)")
        assert why_cannot_listen(f"0.0.0.0:{port}") is not None  # the wildcard needs the loopback port too
    assert why_cannot_listen(f"127.0.0.1:{port}") is None  # released


def test_an_address_that_is_not_this_hosts() -> None:
    own = {a.address for addresses in psutil.net_if_addrs().values() for a in addresses}
    # TEST-NET-3, for documentation; some machines take an address of such a range all the same.
    foreign = next(f"203.0.113.{n}" for n in range(1, 255) if f"203.0.113.{n}" not in own)
    assert why_cannot_listen(f"{foreign}:{free_port()}") == "the address is not one of this host's"


def test_what_it_cannot_judge_is_left_to_grpc() -> None:
    assert why_cannot_listen("not an address") is None
    assert why_cannot_listen(f"no-such-host.invalid:{free_port()}") is None
