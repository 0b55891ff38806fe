"""A worker waits for the scheduler's port before MindSpore's init() (trainer/runtime/scheduler_wait.py)."""

from __future__ import annotations

import socket
import threading
import time

from trainer.runtime.scheduler_wait import wait_for_scheduler


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_returns_once_the_scheduler_listens() -> None:
    port = _free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_later() -> None:
        time.sleep(0.2)
        server.bind(("127.0.0.1", port))
        server.listen()

    thread = threading.Thread(target=listen_later)
    started = time.monotonic()
    thread.start()
    try:
        assert wait_for_scheduler(f"127.0.0.1:{port}", limit_s=10.0)
        waited = time.monotonic() - started
        assert 0.2 <= waited < 5.0
    finally:
        thread.join()
        server.close()


def test_gives_up_after_the_limit_and_lets_init_go_ahead() -> None:
    port = _free_port()  # nobody listens there
    started = time.monotonic()
    assert not wait_for_scheduler(f"127.0.0.1:{port}", limit_s=0.1)
    assert time.monotonic() - started < 5.0
