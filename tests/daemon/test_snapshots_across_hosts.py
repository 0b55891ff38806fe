"""In-memory snapshots of a generation spanning hosts (issue 15 items 2-3), as the coordinator decides
them: who snapshots, whose snapshots each node copies (a ring over the node order), and where a
relaunch resumes from when hosts are lost: the newest step whose every rank's files survive on a live
host, else the disk checkpoint, saying why. Through the Coordinator and the JobController on the
in-memory store with a fake clock (tests/daemon/job_sim.py)."""

from __future__ import annotations

import asyncio

import pytest

from daemon.grpc_services import command_to_proto, held_snapshots
from daemon.job.observation import MemorySnapshot, RootCause
from daemon.job.placement import Placement, RankSlot
from daemon.job.reports import CheckpointCommitted, GenerationStopped
from daemon.job.snapshot_claims import admitted
from daemon.job.state import GenerationRecord, ResumeSource, SnapshotHolder
from daemon.message_checks import MalformedMessage
from proto import trainerd_pb2 as pb
from proto.vocabulary import JobState
from tests.daemon.job_sim import GLOBAL_BATCH, SESSION_GRACE_S, SimCluster, crash_and_relaunch, running_cluster

PEER_PORT = 7431


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def held(step: int, *ranks: int, world_size: int = 3, generation: int = 1) -> MemorySnapshot:
    return MemorySnapshot(step, step * GLOBAL_BATCH, frozenset(ranks), world_size, generation)


def hold_ring(sim: SimCluster, step: int) -> None:
    """Each of a, b, c (ranks 0, 1, 2) holds its own rank and a copy of its ring predecessor's."""
    for node, ranks in {"a": (0, 2), "b": (1, 0), "c": (2, 1)}.items():
        sim.agents[node].held = (held(step, *ranks),)


async def lose(sim: SimCluster, *nodes: str) -> None:
    for node in nodes:
        sim.disconnect(node)
    await sim.tick(SESSION_GRACE_S + 0.5)
    assert sim.state is JobState.RECOVERING
    sim.confirm_stop(*(n for n in sim.job.inbox.generation.placement.nodes if n not in nodes))
    await sim.tick(0.1)


def test_a_generation_spanning_hosts_snapshots_and_copies_around_a_ring_when_every_agent_serves() -> None:
    async def scenario() -> None:
        sim = await running_cluster(peer_port=PEER_PORT)
        for node, predecessor in {"a": "c", "b": "a", "c": "b"}.items():
            launch = sim.agents[node].launches()[-1]
            env = launch.processes[-1].env
            assert (env["TRAINERD_MEMORY_EVERY"], env["TRAINERD_MEMORY_SCOPE"]) == ("auto", "host")
            address = sim.job.inbox.generation.peer_addresses[predecessor]
            assert launch.copy_from == (predecessor, address) and address.endswith(f":{PEER_PORT}")
            assert launch.peer_nodes == ("a", "b", "c")  # whom its SnapshotPeer serves
            assert list(command_to_proto(launch).launch.peer_nodes) == ["a", "b", "c"]

        without = await running_cluster()  # agents that serve no SnapshotPeer
        launch = without.agents["a"].launches()[-1]
        assert launch.processes[-1].env["TRAINERD_MEMORY_EVERY"] == "0" and launch.copy_from is None
    run(scenario())


def test_a_lost_host_resumes_from_the_copies_its_neighbours_hold_resharded_to_the_hosts_left() -> None:
    async def scenario() -> None:
        sim = await running_cluster(peer_port=PEER_PORT)
        hold_ring(sim, 20)
        sim.step(23)
        await sim.tick()
        await lose(sim, "b")
        assert sim.world() == ["a", "c"]
        resume = sim.job.inbox.generation.resume
        assert (resume.source, resume.step, resume.consumed_samples) == (ResumeSource.MEMORY, 20, 20 * GLOBAL_BATCH)
        addresses = sim.job.inbox.generation.peer_addresses
        # Rank 1 (b's) survives only as c's copy; ranks 0 and 2 each on a node of the new placement.
        assert resume.holders == (SnapshotHolder(0, "a", addresses["a"]), SnapshotHolder(1, "c", addresses["c"]),
                                  SnapshotHolder(2, "a", addresses["a"]))
        for node in ("a", "c"):
            launch = sim.agents[node].launches()[-1]
            assert launch.snapshot_sources == resume.holders and launch.checkpoint_path == ""
            assert launch.processes[-1].env["TRAINERD_RESUME_MEMORY_STEP"] == "20"
        assert sim.agents["a"].launches()[-1].copy_from == ("c", addresses["c"])  # a ring of two
        assert {sim.agents[node].launches()[-1].peer_nodes for node in ("a", "c")} == {("a", "c")}
        started = [e for e in await sim.coordinator.events(0) if e.kind == "generation_started"][-1]
        assert "from the in-memory snapshot at step 20 held by a, c" in started.message

        # The record a new leader relaunches from keeps where each rank is held.
        again = GenerationRecord.from_json(sim.job.inbox.generation.to_json())
        assert again.resume == resume and again.peer_addresses == addresses
    run(scenario())


def test_two_neighbours_lost_together_fall_back_to_disk_and_say_why() -> None:
    async def scenario() -> None:
        sim = await running_cluster(peer_port=PEER_PORT)
        hold_ring(sim, 20)
        sim.step(23)
        await sim.tick()
        await lose(sim, "a", "b")  # rank 0 was on a and copied to b only
        assert sim.world() == ["c"]
        resume = sim.job.inbox.generation.resume
        assert (resume.source, resume.step) == (ResumeSource.DISK, 10)
        started = [e for e in await sim.coordinator.events(0) if e.kind == "generation_started"][-1]
        assert ("from the checkpoint at step 10 (no complete in-memory snapshot survives: ranks 0 of step 20 "
                "were held only by a, b)") in started.message
    run(scenario())


def test_steps_only_some_ranks_took_explain_nothing_when_the_disk_checkpoint_is_as_new() -> None:
    """Per-rank `auto` intervals: a step newer than the checkpoint that not every rank took is no snapshot
    lost with a node, and the event must not say one was (the demo said "held only by no node")."""
    async def scenario() -> None:
        sim = await running_cluster(peer_port=PEER_PORT)
        sim.agents["a"].held = (held(14, 2), held(10, 0, 2))  # c's rank 2 took 14 too; a copied it
        sim.agents["b"].held = (held(12, 1), held(10, 1, 0))
        sim.agents["c"].held = (held(14, 2), held(12, 1), held(10, 2, 1))
        sim.step(15)
        await sim.tick()
        await lose(sim, "c")  # 10, complete on a and b, is no newer than the checkpoint of 10
        resume = sim.job.inbox.generation.resume
        assert (resume.source, resume.step) == (ResumeSource.DISK, 10)
        started = [e for e in await sim.coordinator.events(0) if e.kind == "generation_started"][-1]
        assert started.message.endswith("from the checkpoint at step 10"), started.message
    run(scenario())


def test_a_step_is_chosen_only_when_its_holders_agree_on_what_it_is() -> None:
    async def scenario() -> None:
        sim = await running_cluster(peer_port=PEER_PORT)
        sim.agents["a"].held = (held(30, 0, 2, generation=1), held(20, 0, 2))
        sim.agents["c"].held = (held(30, 2, 1, generation=5), held(20, 2, 1))  # not the same step 30
        sim.step(33)
        await sim.tick()
        await lose(sim, "b")
        assert sim.job.inbox.generation.resume.step == 20
    run(scenario())


def test_a_stop_confirmation_names_fresher_holdings_than_the_heartbeats() -> None:
    async def scenario() -> None:
        sim = await running_cluster(peer_port=PEER_PORT)
        hold_ring(sim, 20)
        sim.step(26)
        await sim.tick()
        sim.disconnect("b")
        await sim.tick(SESSION_GRACE_S + 0.5)
        generation = sim.job.inbox.generation.number
        for node, ranks in {"a": (0, 2), "c": (2, 1)}.items():
            sim.coordinator.report(sim.agents[node].session, GenerationStopped(generation, None, (held(25, *ranks),)))
        await sim.coordinator.tick()  # decided on the confirmations, before another heartbeat
        assert sim.job.inbox.generation.resume.step == 25
    run(scenario())


@pytest.mark.parametrize("hostile", [
    [pb.MemorySnapshot(step=20, world_size=3, ranks=[3])],          # a rank outside the world
    [pb.MemorySnapshot(step=20, world_size=3, ranks=[])],           # holds nothing
    [pb.MemorySnapshot(step=20, world_size=2, ranks=[0, 1, 1])],    # more ranks than the world has
    [pb.MemorySnapshot(step=20, world_size=3, ranks=[0])] * 9,      # more steps than an agent keeps
    [pb.MemorySnapshot(step=-1, world_size=3, ranks=[0])],
])
def test_hostile_holdings_are_refused(hostile) -> None:
    with pytest.raises(MalformedMessage):
        held_snapshots(hostile)


def test_a_node_outside_the_placement_claiming_every_rank_is_not_believed() -> None:
    """Issue 47: a host with a valid node certificate, never in the placement, claimed every rank's files
    and the relaunch fetched them all from it. Claims bind only from the nodes told to hold them."""
    async def scenario() -> None:
        sim = await running_cluster(peer_port=PEER_PORT)
        outsider = await sim.connect("x")  # READY and serving, but max_nodes 3: not in the generation
        outsider.generation = 1  # it says it runs the generation, as a forger would
        outsider.held = (held(20, 0, 1, 2),)
        sim.step(23)
        await sim.tick()
        assert "x" not in sim.job.inbox.observation.held_snapshots
        await crash_and_relaunch(sim)
        resume = sim.job.inbox.generation.resume
        assert (resume.source, resume.step) == (ResumeSource.DISK, 10)
        assert all(h.node != "x" for h in resume.holders)
    run(scenario())


def test_a_placed_node_is_believed_only_for_its_own_ranks_and_its_ring_predecessors() -> None:
    async def scenario() -> None:
        sim = await running_cluster(peer_port=PEER_PORT)
        # a runs rank 0 and copies c (rank 2); it claims b's rank 1 too, which nobody else holds.
        sim.agents["a"].held = (held(20, 0, 1, 2),)
        sim.agents["c"].held = (held(20, 2),)
        sim.step(23)
        await sim.tick()
        await crash_and_relaunch(sim)
        assert (sim.job.inbox.generation.resume.source, sim.job.inbox.generation.resume.step) == (ResumeSource.DISK, 10)
    run(scenario())


@pytest.mark.parametrize("step", [10**9, 1 << 62])
def test_a_step_beyond_the_newest_reported_is_not_believed(step: int) -> None:
    """Issue 47: claims at step 10**9 (files the forger wrote) and at 2**62 (no files: the agents launched at
    TRAINERD_RESUME_STEP=2**62) from the job's own nodes: the job has reported step 23, so neither binds."""
    async def scenario() -> None:
        sim = await running_cluster(peer_port=PEER_PORT)
        hold_ring(sim, step)
        sim.step(23)
        await sim.tick()
        assert sim.job.inbox.observation.held_snapshots == {}
        await crash_and_relaunch(sim)
        assert (sim.job.inbox.generation.resume.source, sim.job.inbox.generation.resume.step) == (ResumeSource.DISK, 10)
        assert all(p.env.get("TRAINERD_RESUME_STEP") == "10" for p in sim.agents["a"].launches()[-1].processes
                   if p.role == "worker")
    run(scenario())


def test_a_commit_beyond_the_newest_reported_step_is_not_recorded() -> None:
    """Issue 47: rank 0's node committed step 2**62 (then 2**48 caps it at the servicer); the catalog takes no
    commit beyond the steps the job reported."""
    async def scenario() -> None:
        sim = await running_cluster(peer_port=PEER_PORT)
        sim.step(23)
        sim.coordinator.report(sim.agents["a"].session, CheckpointCommitted(1, 10**9, 10**9 * GLOBAL_BATCH,
                                                                            "/ckpt/step_1000000000"))
        await sim.tick()
        assert [c.step for c in sim.job.catalog.entries()] == [10]
    run(scenario())


def test_copies_of_a_predecessor_made_in_a_later_generation_bind() -> None:
    """Pure: a node holds the ranks of a snapshot's generation that were its own then, and those of the node it
    copied, then or in a later generation (its pins of the older one are what that predecessor serves)."""
    def placement(*nodes: str) -> Placement:
        return Placement(len(nodes), 1, tuple(RankSlot(r, n, f"h{n}", 0, "", 0) for r, n in enumerate(nodes)))

    placements = {1: placement("a", "b", "c"), 2: placement("c", "d")}  # d copies c in generation 2
    claims = admitted("d", None, (held(20, 2),), placements, 2, 30)
    assert claims.held == (held(20, 2),) and claims.refused == ()
    claims = admitted("d", None, (held(20, 1),), placements, 2, 30)
    assert claims.held == () and "ranks 1 of step 20" in claims.refused[0]
    assert admitted("a", None, (held(20, 0),), placements, 2, 30).refused[0].startswith("node a is not in")
    assert admitted("c", None, (held(20, 2, world_size=2),), placements, 2, 30).held == ()


def test_a_snapshot_the_agents_cannot_assemble_is_named_in_the_events_and_the_next_source_is_used() -> None:
    """Issue 47: an assembled snapshot that fails verification never launches (the agent starts no worker on it
    and reports each exited 65: tests/agent/test_snapshot_keeper.py); the coordinator says which snapshot and
    why in a `snapshot_unusable` event and relaunches from the next newest source."""
    async def scenario() -> None:
        sim = await running_cluster(peer_port=PEER_PORT)
        hold_ring(sim, 20)
        sim.step(23)
        await sim.tick()
        await lose(sim, "b")
        assert (sim.job.inbox.generation.resume.source, sim.job.inbox.generation.resume.step) == (ResumeSource.MEMORY, 20)
        problem = "cannot resume from the in-memory snapshot of step 20: rank 1's file fails its digest"
        sim.started()
        sim.crash("a", 0, exit_code=65, cause=RootCause(problem, kind="last_line"))
        await sim.tick()
        sim.confirm_stop()
        await sim.tick(1.0)
        unusable = [e for e in await sim.coordinator.events(0) if e.kind == "snapshot_unusable"]
        assert [e.fields["step"] for e in unusable] == [20] and problem in unusable[0].message
        assert (sim.job.inbox.generation.resume.source, sim.job.inbox.generation.resume.step) == (ResumeSource.DISK, 10)
    run(scenario())
