"""The leader's in-memory copies of etcd (nodes, job status record, checkpoint catalog, skip ledger)
follow FencedCache's one policy for a lost compare-and-swap: the write raises, the copy holds what
etcd holds, and deciding again from it works. Run end to end through the Coordinator on the
in-memory store with a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from daemon.job.skip_ledger import checked
from daemon.store import codec, keys
from daemon.store.fenced_cache import WriteConflict
from daemon.store.interface import LeadershipLost
from daemon.store.memory import InMemoryStore
from proto.vocabulary import JobState
from tests.daemon.job_sim import SimCluster, running_cluster


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def change_behind_the_leader(store: InMemoryStore, key: str, **changes) -> None:
    """What an operator's etcdctl (or a write whose answer the leader never got) does to a key."""
    kv = await store.get(key)
    value = {**codec.decode(kv.value, key=key), **changes}
    assert await store.compare_and_swap(key, codec.encode(value), kv.mod_revision) is not None


def test_the_status_record_changed_behind_the_leader_is_re_read_and_decided_again() -> None:
    async def scenario() -> None:
        sim = await running_cluster()
        await change_behind_the_leader(sim.store, keys.job_status("job"), restarts=7)
        with pytest.raises(WriteConflict):
            await sim.coordinator.pause(now=True)
        assert sim.job.record.restarts == 7 and sim.state is JobState.RUNNING
        await sim.coordinator.pause(now=True)  # decided from etcd's record: its restarts are kept
        kv = await sim.store.get(keys.job_status("job"))
        assert codec.decode(kv.value, key=kv.key)["restarts"] == 7 and sim.state is JobState.PAUSED
    run(scenario())


def test_a_node_record_changed_behind_the_leader_is_re_read() -> None:
    async def scenario() -> None:
        sim = await running_cluster()
        await change_behind_the_leader(sim.store, keys.node("a"), drained=True)
        with pytest.raises(WriteConflict):
            await sim.coordinator.set_drain("a", True)
        revision = (await sim.store.get_prefix(keys.ROOT))[1]
        assert await sim.coordinator.set_drain("a", True) == "node a is drained"
        assert (await sim.store.get_prefix(keys.ROOT))[1] == revision  # the copy knows: nothing to write
    run(scenario())


def test_a_checkpoint_entry_changed_behind_the_leader_is_re_read() -> None:
    async def scenario() -> None:
        sim = await running_cluster()
        fence = sim.coordinator.leadership.fence
        await change_behind_the_leader(sim.store, keys.checkpoint("job", 10), problem="digest mismatch")
        with pytest.raises(WriteConflict):
            await sim.job.catalog.mark_bad(10, "unreadable", fence)
        assert sim.job.catalog.get(10).problem == "digest mismatch"
        await sim.job.catalog.mark_bad(10, "unreadable", fence)  # already bad: nothing to write
        assert sim.job.catalog.get(10).problem == "digest mismatch"
    run(scenario())


def test_a_skip_created_behind_the_leader_is_re_read_and_then_already_in_the_ledger() -> None:
    async def scenario() -> None:
        sim = await running_cluster()
        entry = {"start": 0, "end": 12, "reason": "etcdctl", "step": 0, "generation": 0}
        assert await sim.store.compare_and_swap(keys.skip("job", f"{0:015d}-{12:015d}"), codec.encode(entry), 0)
        with pytest.raises(WriteConflict):
            await sim.coordinator.add_skip(0, 12, "bad shard")
        assert sim.job.ledger.ranges() == ((0, 12),)
        assert await sim.coordinator.add_skip(0, 12, "bad shard") == "samples 0:12 were already in the ledger"
    run(scenario())


def test_a_deposed_leaders_writes_are_lost_leadership() -> None:
    async def scenario() -> None:
        sim = await running_cluster()
        fence = sim.coordinator.leadership.fence
        standby = SimCluster(sim.spec, store=sim.store, clock=sim.clock, name="c2")
        sim.store.stop_keepalive(sim.coordinator.leadership.lease)
        sim.clock.advance(3.5)
        await standby.lead()  # expires the old lease and takes the leader key
        await standby.coordinator.pause()
        with pytest.raises(LeadershipLost):
            await sim.job._write_record(sim.job.record.moved_to(JobState.FAILED), fence)
        assert sim.state is JobState.PAUSED  # the old leader's copy mirrors its successor's decision
        with pytest.raises(LeadershipLost):
            await sim.job.catalog.mark_bad(10, "unreadable", fence)
        with pytest.raises(LeadershipLost):
            await sim.job.ledger.add(checked(0, 12, "bad shard"), fence)
        with pytest.raises(LeadershipLost):
            await sim.coordinator._membership.set_drained("a", True, fence)
    run(scenario())
