"""The embedded etcd is restarted when it dies (same ports, same data) and given up on when the
restart fails or it dies too often. Real etcd processes, real signals."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path

import pytest

from common.clock import FakeClock
from daemon.etcd_process import EmbeddedEtcd, EtcdStartError
from daemon.etcd_supervisor import EtcdKeepsDying, EtcdSupervisor
from daemon.store.etcd import EtcdStore
from tests.ports import free_port


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


class CountedEtcd(EmbeddedEtcd):
    """Counts the starts that returned: the etcd serves, and its supervisor watches it again."""

    starts = 0

    async def start(self, timeout_s: float = 10.0) -> None:
        await super().start(timeout_s)
        self.starts += 1


async def kill_and_see_it_restarted(etcd: CountedEtcd, supervising: asyncio.Task) -> None:
    pid, starts = etcd._process.pid, etcd.starts
    os.kill(pid, signal.SIGKILL)
    while etcd.starts == starts:
        assert not supervising.done(), supervising.exception()
        await asyncio.sleep(0.02)
    assert etcd._process.pid != pid and etcd._process.poll() is None


def test_wait_exited_tells_the_signal_that_killed_etcd(tmp_path: Path) -> None:
    async def scenario() -> None:
        etcd = EmbeddedEtcd(tmp_path, free_port(), free_port())
        await etcd.start()
        waiting = asyncio.create_task(etcd.wait_exited())
        await asyncio.sleep(0.1)
        assert not waiting.done()
        os.kill(etcd._process.pid, signal.SIGKILL)
        assert await waiting == -signal.SIGKILL
        assert await etcd.wait_exited() == -signal.SIGKILL  # at once, once it is gone
    run(scenario())


def test_a_killed_etcd_is_restarted_on_the_same_port_with_its_data(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        etcd = CountedEtcd(tmp_path, free_port(), free_port())
        await etcd.start()
        store = await EtcdStore.connect([etcd.endpoint])
        await store.compare_and_swap("/trainerd/v1/kept", b"before the kill", 0)
        await store.close()
        supervising = asyncio.create_task(EtcdSupervisor(etcd, clock).run())
        try:
            for _ in range(4):
                await kill_and_see_it_restarted(etcd, supervising)
                clock.advance(31)  # never three deaths within one 60 s window
            store = await EtcdStore.connect([etcd.endpoint])
            assert (await store.get("/trainerd/v1/kept")).value == b"before the kill"
            await store.close()
            assert not supervising.done()
        finally:
            supervising.cancel()
            await asyncio.gather(supervising, return_exceptions=True)
            await etcd.stop()
    run(scenario())


def test_an_etcd_that_dies_three_times_within_a_minute_is_given_up(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        etcd = CountedEtcd(tmp_path, free_port(), free_port())
        await etcd.start()
        supervising = asyncio.create_task(EtcdSupervisor(etcd, clock).run())
        try:
            for _ in range(2):
                await kill_and_see_it_restarted(etcd, supervising)
                clock.advance(20)
            os.kill(etcd._process.pid, signal.SIGKILL)
            with pytest.raises(EtcdKeepsDying, match="died 3 times within 60s .*killed by signal 9"):
                await supervising
        finally:
            supervising.cancel()
            await etcd.stop()
    run(scenario())


def test_a_restart_that_fails_ends_the_supervisor_with_etcd_s_reason(tmp_path: Path) -> None:
    async def scenario() -> None:
        etcd = EmbeddedEtcd(tmp_path, free_port(), free_port())
        await etcd.start()
        os.kill(etcd._process.pid, signal.SIGKILL)  # dead before its supervisor starts: its data is broken first
        etcd._process.wait()
        shutil.rmtree(tmp_path / "data")
        (tmp_path / "data").write_text("not a directory")
        with pytest.raises(EtcdStartError, match="exited with code 1 while starting: .*data"):
            await EtcdSupervisor(etcd, FakeClock()).run()
    run(scenario())
