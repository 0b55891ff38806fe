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

TESTS = Path(__file__).parent
INTEGRATION = TESTS / "integration"

# `make test` runs on pytest-xdist workers (`--dist loadgroup --no-loadscope-reorder`), and the integration tests,
# each a whole cluster (trainerd, agents, MindSpore workers), in two lanes: at most two clusters train at once on
# this 2-core machine, beside the other tests. The files are split by their measured durations (the `--durations`
# of a `make test` log); those of the cluster box (network namespaces of fixed addresses) share one lane. A file
# not named here runs in lane 1. test_job_launch.py and test_chaos.py share a lane: both compare with the
# session's fault-free run (tests/integration/conftest.py), made once per worker. Every other test file is a
# group of its own, run by one worker in order: its module-scoped fixtures (a MindSpore job for
# tests/trainer/test_callback.py) are made once, not once per worker, and a test that checks what the one before
# it left (the fuzzers' last test) finds it.
LANE_0 = {"test_chaos.py", "test_peer_snapshots.py", "test_join_cluster_box.py", "test_recovery.py",
          "test_tls_cluster.py", "test_slow_peer.py", "test_embedded_etcd.py", "test_job_launch.py"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the xdist_group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/integration is a `mindspore` test (`make test-fast` leaves them out, with the tests
    marked so in their module) and runs in its lane (an xdist group: one worker runs a group's tests one after
    another); every other file is a group of its own. The lanes go first: they are the longest, and the other
    workers work through the rest beside them."""
    for item in items:
        if INTEGRATION in item.path.parents:
            item.add_marker(pytest.mark.mindspore)
            item.add_marker(pytest.mark.xdist_group(f"cluster-lane-{0 if item.path.name in LANE_0 else 1}"))
        elif not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(f"file-{item.path.relative_to(TESTS)}"))
    items.sort(key=lambda item: INTEGRATION not in item.path.parents)


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
