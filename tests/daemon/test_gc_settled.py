"""`trainerd start` freezes its start-up heap out of the garbage collector before it serves an agent
(daemon/app.py settle_gc_for_serving: full collections over 10,000 sessions stalled the event loop)."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

from daemon.app import GC_YOUNG_THRESHOLD, TrainerdApp
from daemon.config import load_cluster_config
from daemon.etcd_process import EmbeddedEtcd
from tests.ports import free_port


def test_a_serving_trainerd_has_frozen_its_start_up_heap(etcd_server: EmbeddedEtcd, tmp_path: Path) -> None:
    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(f"cluster:\n  name: gc\n  coordinator: {{listen: '127.0.0.1:{free_port()}'}}\n"
                            f"  etcd: {{endpoints: ['{etcd_server.endpoint}']}}\n")
    app = TrainerdApp(load_cluster_config(cluster_file))
    thresholds = gc.get_threshold()

    async def serve_then_stop() -> None:
        stop = asyncio.Event()
        serving = asyncio.create_task(app.run(stop))
        while app.coordinator is None or app.coordinator.leadership is None:
            assert not serving.done()
            await asyncio.sleep(0.05)
        stop.set()
        await serving

    try:
        assert gc.get_freeze_count() == 0
        asyncio.run(serve_then_stop())
        assert gc.get_freeze_count() > 10_000
        assert gc.get_threshold()[0] == GC_YOUNG_THRESHOLD
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
