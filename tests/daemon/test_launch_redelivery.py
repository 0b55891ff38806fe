"""A Launch sent into a session whose agent end had already closed is lost with it: the coordinator learns
the stream is gone only later, and counted the node as launched. When that agent opens its next session, a
node of the live generation that has reported none of its processes gets its Launch again; one that runs
them does not (an agent would ignore the repeat, but the coordinator has no reason to send it). Before this
the generation waited for the node's ranks until the hang timeout (300 s by default): a CI failure of
tests/integration/test_chaos.py. Through the Coordinator and the JobController on the in-memory store."""

from __future__ import annotations

import asyncio

from tests.daemon.job_sim import SimCluster, job_settings, running_cluster


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_a_launch_lost_with_a_closing_session_is_sent_again_when_the_node_reconnects() -> None:
    async def scenario() -> None:
        sim = SimCluster(job_settings())
        await sim.lead()
        for name in ("a", "b", "c"):
            await sim.connect(name)
        sim.agents["c"].session.send = lambda command: None  # its agent has left; the coordinator cannot tell yet
        await sim.tick()
        assert sim.job.record.generation == 1 and sorted(sim.job.inbox.generation.placement.nodes) == ["a", "b", "c"]
        assert [len(sim.agents[n].launches()) for n in ("a", "b", "c")] == [1, 1, 0]

        for _ in range(3):  # nothing sends it again while the old session looks open
            await sim.tick(1.0)
        assert sim.agents["c"].launches() == []

        await sim.connect("c")  # the agent's next session (its resume token replaces the old one)
        await sim.connect("a")  # a node that got its Launch reconnects too, before reporting its processes
        await sim.tick()
        assert [launch.generation for launch in sim.agents["c"].launches()] == [1]
        assert len(sim.agents["a"].launches()) == 2  # a repeat its agent ignores: it may have been lost as well

        sim.started()
        await sim.connect("b")  # b runs its processes: no second Launch
        await sim.tick()
        assert len(sim.agents["b"].launches()) == 1
        assert sim.job.record.generation == 1
    run(scenario())


def test_a_stop_lost_with_a_closing_session_is_sent_again_when_the_node_reconnects() -> None:
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b", "c"))
        sim.agents["c"].session.send = lambda command: None
        sim.crash("a", 0)
        await sim.tick()
        assert [len(sim.agents[n].stops()) for n in ("a", "b", "c")] == [1, 1, 0]
        sim.confirm_stop("a", "b")
        await sim.tick(0.5)
        assert sim.job.record.generation == 1  # c still runs generation 1 and has not confirmed

        await sim.connect("c")
        sim.agents["c"].generation = 1  # its processes kept running across the reconnect
        await sim.tick()
        assert [stop.generation for stop in sim.agents["c"].stops()] == [1]
        sim.confirm_stop("c")
        await sim.tick(1.0)
        assert sim.job.record.generation == 2
        assert sorted(sim.job.inbox.generation.placement.nodes) == ["a", "b", "c"]  # c was not left out as busy
        await sim.connect("c")  # it confirmed: reconnecting again sends nothing more
        await sim.tick()
        assert [stop.generation for stop in sim.agents["c"].stops()] == [1]
    run(scenario())
