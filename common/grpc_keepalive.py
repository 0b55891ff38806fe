"""gRPC keepalive options that end a connection whose peer stopped answering, for trainerd's long-lived
channels and its server: agent -> coordinator, the coordinator's server, coordinator -> etcd.

A peer that froze (SIGSTOP, a wedged process) or whose host lost its link sends no FIN: the kernel
keeps the connection, and a call on it waits for ever unless the transport pings. gRPC pings every
`grpc.keepalive_time_ms`; with grpcio 1.85 the answer to a ping is timed by `grpc.http2.ping_timeout_ms`
(default 60 s), whatever `grpc.keepalive_timeout_ms` says. Measured: a client whose server was
SIGSTOPped saw its call end 70.0 s after the last answer with only `keepalive_timeout_ms=5000` set,
15.0 s with `ping_timeout_ms=5000` beside it (tests/agent/test_coordinator_link.py and
tests/store/test_etcd_store.py hold this). So both are set, to the same value.

A server also ends a connection whose client never completes its TLS handshake (`handshake_options`).
"""

from __future__ import annotations


def keepalive_options(ping_every_s: float, answer_within_s: float,
                      without_calls: bool) -> list[tuple[str, int]]:
    """Ping the peer every `ping_every_s` and end the connection, and every call on it, when a ping is
    not answered within `answer_within_s`. `without_calls`: ping also while no call is open (a gRPC-Go
    server such as etcd refuses those by default, with GOAWAY "too_many_pings", so etcd's channels do not)."""
    answer_ms = round(answer_within_s * 1000)
    return [("grpc.keepalive_time_ms", round(ping_every_s * 1000)),
            ("grpc.keepalive_timeout_ms", answer_ms),
            ("grpc.http2.ping_timeout_ms", answer_ms),
            ("grpc.keepalive_permit_without_calls", int(without_calls))]


# How long a server waits for a new connection's handshake: a TLS handshake takes a few round trips.
HANDSHAKE_TIMEOUT_S = 10.0


def handshake_options() -> list[tuple[str, int]]:
    """End a server's connection whose client has not completed its handshake within HANDSHAKE_TIMEOUT_S.
    gRPC does each handshake on its own, off the accept path, but waits 120 s by default: idle TCP
    connections (a port scan, a stalled client) held their descriptors and memory that long."""
    return [("grpc.server_handshake_timeout_ms", round(HANDSHAKE_TIMEOUT_S * 1000))]
