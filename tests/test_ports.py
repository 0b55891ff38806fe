"""The tests' ports: each pytest-xdist worker hands out its own, so that no two workers' servers share one."""

from __future__ import annotations

import pytest

from tests import ports


def test_each_xdist_worker_hands_out_ports_of_its_own_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    slices = []
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        low, top = ports._port_range()
        assert low < top and low + ports.SCHEDULER_PORT_RUN < top
        assert low <= ports.free_port() < top
        base = ports.scheduler_port()
        assert low <= base and base + ports.SCHEDULER_PORT_RUN <= top
        slices.append(range(low, top))
    assert slices[0].stop <= slices[1].start and slices[1].stop <= slices[2].start
    assert slices[0].start == 10_000 and slices[2].stop <= ports._ephemeral_start()


def test_outside_xdist_every_port_below_the_ephemeral_range_may_be_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert ports._port_range() == (10_000, ports._ephemeral_start())
