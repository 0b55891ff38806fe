"""Fixtures shared by every test directory."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.etcd_process import EmbeddedEtcd, EtcdNotFound, find_etcd_binary
from tests.ports import free_port

# tests/mindformers_real needs MindFormers itself, which this venv cannot install: `make test-mindformers` runs it
# (`pytest tests/mindformers_real`, which still collects it) in a venv of its own.
collect_ignore = ["mindformers_real"]


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    """A real single-member etcd on 127.0.0.1, started for one test and stopped after it.

    Synchronous, so sync tests and tests that run their own `asyncio.run` can both use it.
    A missing etcd binary fails the test: the etcd tests are never skipped.
    """
    try:
        find_etcd_binary()
    except EtcdNotFound as exc:
        pytest.fail(str(exc), pytrace=False)
    server = EmbeddedEtcd(tmp_path / "etcd", free_port(), free_port())
    asyncio.run(server.start(timeout_s=10))
    try:
        yield server
    finally:
        asyncio.run(server.stop())
