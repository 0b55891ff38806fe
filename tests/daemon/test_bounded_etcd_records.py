"""What the coordinator keeps in etcd does not grow with the job's age (fake clock, in-memory store): a job
that restarts for weeks does not fill etcd with rank tables, nor one that saves for weeks with catalog
entries of checkpoints long deleted from disk."""

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
            sim.crash(sim.job.inbox.generation.placement.nodes[0], 0)
            await sim.tick()
            sim.confirm_stop()
            await sim.tick(1.0)
        assert sim.job.record.generation == 6
        kvs, _ = await sim.store.get_prefix(keys.generations("job"))
        return [int(kv.key.rsplit("/", 1)[1]) for kv in kvs]

    assert asyncio.run(asyncio.wait_for(scenario(), 20)) == [4, 5, 6]


def test_the_catalog_keeps_the_newest_entries_and_resumes_from_the_newest() -> None:
    async def scenario() -> tuple[list[int], str]:
        sim = await running_cluster(checkpoint={"dir": "/ckpt", "every_steps": 10, "keep": 3},
                                    restart={"max": 10, "backoff_s": 0})
        for step in range(20, 310, 10):
            sim.step(step)
            sim.checkpoint(step)
            await sim.tick()
        kvs, _ = await sim.store.get_prefix(keys.checkpoints("job"))
        sim.crash(sim.job.inbox.generation.placement.nodes[0], 0)
        await sim.tick()
        sim.confirm_stop()
        await sim.tick(1.0)
        launch = sim.agents[sim.job.inbox.generation.placement.nodes[0]].launches()[-1]
        return [int(kv.key.rsplit("/", 1)[1]) for kv in kvs], launch.checkpoint_path

    steps, resumed_from = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert steps == list(range(150, 310, 10))  # 16: max(2 x keep, 16)
    assert resumed_from == "/ckpt/step_00000300"
