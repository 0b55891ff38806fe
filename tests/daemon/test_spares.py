"""Hot spares (job.spare_nodes): READY nodes held out of the placement stand by; a lost node is replaced by
one at the same world size (no reshard: the same gradient accumulation), a node that comes back refills
the spares before the job grows, and `trainerctl status` lists them. The placement functions alone, then
the decisions through the real Coordinator and JobController on the in-memory store (tests/daemon/job_sim.py)."""

from __future__ import annotations

import asyncio

from daemon.cli.status_json import status_to_json
from daemon.cli.trainerctl import print_status
from daemon.grpc_services import job_to_proto, status_to_proto
from daemon.job.commands import StandbyCommand
from daemon.job.placement import NodeOffer, place_keeping_spares, place_replacing_lost
from daemon.job.state import FailureCause
from daemon.membership import DeviceInfo
from proto import trainerd_pb2 as pb
from proto.vocabulary import JobState
from tests.daemon.job_sim import GLOBAL_BATCH, SESSION_GRACE_S, SimCluster, job_settings, running_cluster


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def offers(*names: str) -> list[NodeOffer]:
    return [NodeOffer(name, f"10.0.0.{i + 1}", (DeviceInfo(0, "", "cpu"),)) for i, name in enumerate(names)]


def test_the_last_nodes_in_order_are_held_back_while_the_rest_can_still_be_placed() -> None:
    spec = job_settings(min_nodes=1, max_nodes=4, spare_nodes=2, global_batch=12, micro_batch=1)
    assert place_keeping_spares(spec, offers("a", "b", "c", "d")).nodes == ["a", "b"]
    # a generation's own nodes come first: the newcomer is the one held back
    assert place_keeping_spares(spec, offers("a", "b", "c"), previous_order=["c", "b"]).nodes == ["c"]
    # too few nodes for the job and its spares: the job runs on them rather than wait
    two = job_settings(min_nodes=2, max_nodes=3, spare_nodes=2, global_batch=12, micro_batch=1)
    assert place_keeping_spares(two, offers("a", "b", "c")).nodes == ["a", "b"]
    assert place_keeping_spares(two, offers("a", "b")).nodes == ["a", "b"]
    assert place_keeping_spares(two, offers("a")) is None


def test_after_a_fault_spares_fill_in_up_to_the_world_size_the_job_had() -> None:
    spec = job_settings(min_nodes=1, max_nodes=4, spare_nodes=1, global_batch=12, micro_batch=1)
    # b lost from a generation on a and b; c stood by: the same world size, on a and c
    assert place_replacing_lost(spec, offers("a", "c"), 2, previous_order=["a", "b"]).nodes == ["a", "c"]
    # no spare left: the job shrinks to what there is
    assert place_replacing_lost(spec, offers("a"), 2, previous_order=["a", "b"]).nodes == ["a"]
    # never larger than it was for a fault: growing is a reshape's, with the spares kept
    assert place_replacing_lost(spec, offers("a", "c", "d", "e"), 2, previous_order=["a", "b"]).world_size == 3


def shown(sim) -> dict:
    """What `trainerctl status -o json` shows of the job."""
    return status_to_json(pb.StatusReply(job=job_to_proto(sim.job.view())))["job"]


def test_a_lost_node_is_replaced_by_a_spare_at_the_same_world_size_and_a_returning_one_stands_by(capsys) -> None:
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b", "c"), min_nodes=1, max_nodes=3, spare_nodes=1)
        assert sim.world() == ["a", "b"] and sim.job.record.world_size == 2
        assert shown(sim)["spares"] == ["c"]

        sim.disconnect("b")
        await sim.tick(SESSION_GRACE_S + 0.5)
        assert sim.state is JobState.RECOVERING and sim.job.record.last_failure.cause is FailureCause.NODE_LOST
        sim.confirm_stop("a")
        await sim.tick(0.1)
        assert sim.world() == ["a", "c"] and sim.job.record.world_size == 2
        # the same batch split: no reshard, no new graph
        env = sim.agents["c"].launches()[-1].processes[-1].env
        assert env["TRAINERD_GRAD_ACCUM"] == str(GLOBAL_BATCH // 2) and env["RANK_ID"] == "1"
        assert sim.agents["c"].launches()[-1].checkpoint_path == "/ckpt/step_00000010"
        assert sim.job.record.crash_restarts == 0
        sim.started()
        sim.step(11)
        await sim.tick(0.1)
        assert sim.state is JobState.RUNNING and shown(sim)["spares"] == []

        await sim.connect("b")  # back: a spare again, not a reshape
        sim.step(12, samples_per_s=GLOBAL_BATCH * 10)
        await sim.tick(0.1)
        assert not sim.agents["a"].checkpoint_requests()
        assert [stop for stop in sim.agents["a"].stops() if stop.generation == 2] == []
        assert sim.state is JobState.RUNNING and sim.world() == ["a", "c"] and shown(sim)["spares"] == ["b"]

        print_status(status_to_json(status_to_proto(await sim.coordinator.view())))
        assert "spares: b" in capsys.readouterr().out

        # Each spare was told to stand by once per generation it stood by for, with the workers it would run:
        # c for generation 1, b (back) for generation 2; no placed node ever was.
        assert [(c.generation, [p.env["DEVICE_ID"] for p in c.processes]) for c in standbys(sim, "c")] == [(1, ["0"])]
        assert [c.generation for c in standbys(sim, "b")] == [2] and standbys(sim, "a") == []
        (told,) = standbys(sim, "b")
        assert told.job_name == sim.job.spec.name and told.processes[0].argv == tuple(sim.job.spec.entrypoint)
        assert told.processes[0].env["TRAINERD_GRAD_ACCUM"] == str(GLOBAL_BATCH // 2)  # the job's import-time env
        await sim.tick(0.1)
        assert len(standbys(sim, "b")) == 1  # not on every pass
    run(scenario())


def standbys(sim, node: str) -> list[StandbyCommand]:
    return [c for c in sim.agents[node].commands if isinstance(c, StandbyCommand)]


def test_a_spare_that_leaves_and_comes_back_is_told_to_stand_by_again() -> None:
    """Its agent may have started anew, without the templates."""
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b", "c"), min_nodes=1, max_nodes=3, spare_nodes=1)
        await sim.tick(0.1)
        assert len(standbys(sim, "c")) == 1
        sim.disconnect("c")
        await sim.tick(0.5)
        await sim.connect("c")
        await sim.tick(0.1)
        assert [c.generation for c in standbys(sim, "c")] == [1, 1] and sim.world() == ["a", "b"]
    run(scenario())


def test_the_first_launch_waits_start_wait_s_for_the_spares_too() -> None:
    """With max_nodes there but not its spares, the first launch waits for them as for any node: launched at
    once, it would run without a spare (or on fewer nodes) and grow when the spare came."""
    async def scenario() -> None:
        sim = SimCluster(job_settings(min_nodes=2, max_nodes=2, spare_nodes=1, start_wait_s=30))
        await sim.lead()
        for name in ("a", "b"):
            await sim.connect(name)
        await sim.tick(1)
        assert sim.job.record.generation == 0
        await sim.connect("c")
        await sim.tick(0.1)
        await sim.tick(0.1)  # status tells the spares of the pass after the launch
        assert sim.world() == ["a", "b"] and shown(sim)["spares"] == ["c"]
    run(scenario())


def test_without_spares_a_returning_node_grows_the_job_as_before() -> None:
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b", "c"), min_nodes=1, max_nodes=3)
        assert sim.world() == ["a", "b", "c"] and shown(sim)["spares"] == []
    run(scenario())
