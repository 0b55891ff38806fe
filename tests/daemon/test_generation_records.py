"""The coordinator keeps the records of the newest generations only (fake clock, in-memory store): a job
that restarts for weeks does not fill etcd with rank tables, and the kept ones still say where ranks ran."""

from __future__ import annotations

import asyncio

import pytest

from daemon.job import controller
from daemon.store import keys
from tests.daemon.job_sim import running_cluster


def test_only_the_newest_generation_records_stay_in_etcd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(controller, "KEPT_GENERATION_RECORDS", 3)

    async def scenario() -> list[int]:
        sim = await running_cluster(restart={"max": 10, "backoff_s": 0})
        for attempt in range(5):
            sim.started()
            sim.step(20 + attempt)
            sim.crash(sim.job.generation.placement.nodes[0], 0)
            await sim.tick()
            sim.confirm_stop()
            await sim.tick(1.0)
        assert sim.job.record.generation == 6
        kvs, _ = await sim.store.get_prefix(keys.generations("job"))
        return [int(kv.key.rsplit("/", 1)[1]) for kv in kvs]

    assert asyncio.run(asyncio.wait_for(scenario(), 20)) == [4, 5, 6]
