"""Free TCP ports on 127.0.0.1 for servers the tests start."""

from __future__ import annotations

import os
import random
import socket

_handed_out: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, that this test session has not handed out before, and below the
    kernel's ephemeral range.

    Below the range, because a port of the range found free may be some outgoing connection's local
    port a moment later (an agent redialling its coordinator takes one a second), and the server the
    test then starts fails to listen: seen in CI as the embedded etcd's "bind: address already in use".
    Not handed out before, because two servers started in one test could otherwise be given the same
    one before either binds it.
    """
    low, top = _port_range()
    for _ in range(1000):
        port = random.randrange(low, top)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    raise RuntimeError("no free port below the ephemeral range")


# Generation g's scheduler listens on scheduler_port + g % 16 (daemon/job/launch_plan.py).
SCHEDULER_PORT_RUN = 16


def _port_range() -> tuple[int, int]:
    """The ports this process hands out: those below the kernel's ephemeral range, or under pytest-xdist
    this worker's own slice of them. Each worker knows only the ports it handed out itself, so without the
    slices a port one worker's server freed for a moment (an etcd killed and started again on it) could be
    found free and handed to another worker's test: seen as test_etcd_supervisor's restarted etcd reading
    another test's data."""
    low, top = 10_000, _ephemeral_start()
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1:
        size = (top - low) // int(count)
        low += int(worker[2:]) * size
        return low, low + size
    return low, top


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def scheduler_port() -> int:
    """A job's `scheduler_port`: the 16 ports its generations take, all free now, none handed out before,
    and below the kernel's ephemeral range, so that no connection's local port can take one later (a
    port of the ephemeral range found free may be some outgoing connection's a moment after: MindSpore's
    scheduler then fails to listen, "Failed to init the tcp server")."""
    low, top = _port_range()
    top -= SCHEDULER_PORT_RUN
    for base in random.sample(range(low, top, SCHEDULER_PORT_RUN), k=min(200, (top - low) // SCHEDULER_PORT_RUN)):
        run = range(base, base + SCHEDULER_PORT_RUN)
        if _handed_out.intersection(run) or not all(_bindable(port) for port in run):
            continue
        _handed_out.update(run)
        return base
    raise RuntimeError("no run of 16 free ports below the ephemeral range")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True
