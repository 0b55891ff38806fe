"""A trainerd with local agents saves the running job before it stops them (daemon/app.py
_save_before_stopping); a second stop signal does not wait for that save."""

from __future__ import annotations

import asyncio
from pathlib import Path

from daemon.app import TrainerdApp
from daemon.config import load_cluster_config


class SavingCoordinator:
    """Stands in for the coordinator's save_before_stopping: answers when `saved` is set."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.saved = asyncio.Event()
        self.cancelled = False

    async def save_before_stopping(self, timeout_s: float) -> None:
        self.asked.set()
        try:
            await self.saved.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


def app_with(coordinator: SavingCoordinator, tmp_path: Path) -> TrainerdApp:
    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text("cluster:\n  name: c\n  local_agents: 1\n")
    app = TrainerdApp(load_cluster_config(cluster_file))
    app.coordinator = coordinator  # type: ignore[assignment]
    return app


def test_trainerd_stops_once_the_save_is_done(tmp_path: Path) -> None:
    coordinator = SavingCoordinator()
    app = app_with(coordinator, tmp_path)

    async def go() -> None:
        stop = asyncio.Event()
        stop.set()  # the first Ctrl-C
        stopping = asyncio.create_task(app._save_before_stopping(stop))
        await asyncio.wait_for(coordinator.asked.wait(), 1)
        await asyncio.sleep(0.1)
        assert not stopping.done()  # waits for the checkpoint
        coordinator.saved.set()
        await asyncio.wait_for(stopping, 1)
        assert not coordinator.cancelled

    asyncio.run(go())


def test_a_second_stop_signal_stops_at_once_without_the_checkpoint(tmp_path: Path) -> None:
    coordinator = SavingCoordinator()
    app = app_with(coordinator, tmp_path)

    async def go() -> None:
        stop = asyncio.Event()
        stop.set()
        stopping = asyncio.create_task(app._save_before_stopping(stop))
        await asyncio.wait_for(coordinator.asked.wait(), 1)
        stop.set()  # the second Ctrl-C
        await asyncio.wait_for(stopping, 1)
        assert coordinator.cancelled

    asyncio.run(go())
