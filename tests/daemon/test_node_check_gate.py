"""job.node_check through the Coordinator and the JobController (in-memory store, fake clock): a node
returning from LOST is sent the check and offered no work until it passes; a failure keeps it out with
the reason in the events; undrain checks it again."""

from __future__ import annotations

import asyncio

from daemon.node_checks import NodeCheckCommand, NodeChecks
from proto.vocabulary import JobState
from tests.daemon.job_sim import SESSION_GRACE_S, SimCluster, running_cluster

CHECK = ["{python}", "-m", "stress_detect"]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def checks_sent(sim: SimCluster, node: str) -> list[NodeCheckCommand]:
    return [c for c in sim.agents[node].commands if isinstance(c, NodeCheckCommand)]


async def events(sim: SimCluster) -> list:
    return await sim.coordinator.events(0, 500)


def test_a_node_back_from_lost_works_again_only_once_it_passes_the_check() -> None:
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b"), min_nodes=2, max_nodes=2, node_check=CHECK,
                                    node_check_timeout_s=60)
        assert not checks_sent(sim, "a") and not checks_sent(sim, "b")  # first contact: no check
        sim.disconnect("b")
        await sim.tick(SESSION_GRACE_S + 1)
        sim.confirm_stop("a")
        await sim.tick(5)
        assert sim.state is JobState.WAITING

        await sim.connect("b")  # back from LOST
        (first,) = checks_sent(sim, "b")
        assert (first.argv, first.timeout_s) == (tuple(CHECK), 60.0)
        await sim.tick(5)
        assert sim.state is JobState.WAITING and len(sim.agents["b"].launches()) == 1  # not offered yet

        sim.coordinator.node_check_result(sim.agents["b"].session, first.check_id, False, "exit code 3: ECC errors")
        await sim.tick(5)
        assert sim.state is JobState.WAITING and len(sim.agents["b"].launches()) == 1
        failed = [e for e in await events(sim) if e.kind == "node_check_failed"]
        assert len(failed) == 1 and "exit code 3: ECC errors" in failed[0].message
        assert failed[0].fields["node"] == "b"

        await sim.coordinator.set_drain("b", False)  # the operator fixed it: checked again
        second = checks_sent(sim, "b")[-1]
        assert second.check_id != first.check_id
        sim.coordinator.node_check_result(sim.agents["b"].session, first.check_id, True, "")  # stale: ignored
        await sim.tick(5)
        assert len(sim.agents["b"].launches()) == 1
        sim.coordinator.node_check_result(sim.agents["b"].session, second.check_id, True, "")
        await sim.tick(5)
        assert sim.job.record.generation == 2 and len(sim.agents["b"].launches()) == 2
        assert "node_check_passed" in [e.kind for e in await events(sim)]
    run(scenario())


def test_no_node_check_no_command_and_nothing_excluded() -> None:
    checks = NodeChecks(None, 60.0)
    assert checks.start("a") is None and checks.excluded() == set()


def test_a_forgotten_node_leaves_nothing_behind() -> None:
    checks = NodeChecks(["{python}", "-c", "pass"], 10.0)
    pending = checks.start("a")
    assert pending is not None
    checks.start("b")
    checks.result("b", 2, False, "device 0 failed")
    assert checks.excluded() == {"a", "b"}
    checks.forget("a")
    checks.forget("b")
    assert checks.excluded() == set() and checks.failed == {}
