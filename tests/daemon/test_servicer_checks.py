"""The servicer checks every field of what an agent sends before the coordinator sees it: a malformed
message is dropped and counted, never raised out of the session loop; a Hello out of bounds is
refused; at most `max_sessions` session streams are open at once."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from prometheus_client import REGISTRY

from agent.session import retry_after_s
from common.clock import FakeClock
from daemon.admission import MIN_RETRY_AFTER_S, HelloAdmission, OpeningGate
from daemon.app import grpc_server
from daemon.cli.status_json import status_to_json
from daemon.cli.trainerctl import print_status
from daemon.coordinator import SessionRefused
from daemon.grpc_services import ControlService, CoordinatorService, hello_from_proto, job_to_proto
from daemon.job.observation import REMEMBERED_STEPS
from daemon.job.reports import CheckpointFailed, WorkerWarned
from daemon.node_checks import NodeCheckCommand
from proto import trainerd_pb2 as pb
from proto import trainerd_pb2_grpc as pb_grpc
from proto.progress_datagram import StartupTimes
from proto.vocabulary import RETRY_AFTER_SPREAD, JobState
from tests.daemon.job_sim import HEARTBEAT_TIMEOUT_S, SESSION_GRACE_S, SimCluster, job_settings, running_cluster


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def dropped(reason: str) -> float:
    return REGISTRY.get_sample_value("trainerd_agent_messages_dropped_total", {"reason": reason}) or 0.0


def hello(**fields) -> pb.Hello:
    message = pb.Hello(node_name="n1", host="10.0.0.1", devices=[pb.Device(device_id=0, kind="cpu")],
                       agent_version="t")
    for name, value in fields.items():
        if name == "devices":
            del message.devices[:]
            message.devices.extend(value)
        else:
            setattr(message, name, value)
    return message


@pytest.mark.parametrize("fields", [
    {"node_name": "n1\n"}, {"node_name": "x" * 64}, {"node_name": ""}, {"host": "h" * 256},
    {"host": "10.0.0.1\nWARNING forged"}, {"host": "\x1b]0;owned\x07"}, {"agent_version": "v\r"},
    {"agent_version": "v" * 10_000}, {"resume_token": "t" * 10_000},
    {"devices": [pb.Device(device_id=i, kind="cpu") for i in range(65)]},
    {"devices": [pb.Device(device_id=-1, kind="cpu")]}, {"devices": [pb.Device(device_id=1 << 20, kind="cpu")]},
    {"devices": [pb.Device(device_id=0, device_ip="1" * 1000, kind="npu")]},
    {"devices": [pb.Device(device_id=0, kind="k" * 100)]},
    {"next_welcome_wait_s": math.nan}, {"next_welcome_wait_s": -1.0}, {"next_welcome_wait_s": 61.0},
], ids=lambda fields: next(iter(fields)))
def test_a_hello_out_of_bounds_is_refused_before_it_is_used(fields: dict) -> None:
    with pytest.raises(SessionRefused, match="malformed Hello"):
        hello_from_proto(hello(**fields))


def test_a_hello_within_bounds_passes() -> None:
    assert hello_from_proto(hello()).node_name == "n1"


def malformed_messages(generation: int) -> list[pb.AgentMessage]:
    """One message of every kind, each with one field out of bounds."""
    worker = dict(role="worker", rank=0, pid=200)
    return [
        pb.AgentMessage(),
        pb.AgentMessage(hello=hello()),
        pb.AgentMessage(heartbeat=pb.Heartbeat(generation=-1)),
        pb.AgentMessage(heartbeat=pb.Heartbeat(generation=generation, sent_at=math.inf)),
        pb.AgentMessage(heartbeat=pb.Heartbeat(generation=generation, processes=[
            pb.ProcessStatus(**worker, state=pb.PROCESS_RUNNING)] * 257)),
        pb.AgentMessage(heartbeat=pb.Heartbeat(generation=generation, processes=[
            pb.ProcessStatus(role="daemon", rank=0, state=pb.PROCESS_EXITED, exit_code=1)])),
        pb.AgentMessage(process_exited=pb.ProcessExited(generation=generation, role="worker", rank=1 << 20,
                                                        exit_code=1)),
        pb.AgentMessage(process_exited=pb.ProcessExited(generation=generation, role="scheduler", rank=0,
                                                        exit_code=1)),
        pb.AgentMessage(process_started=pb.ProcessStarted(generation=generation, role="worker", rank=-2)),
        pb.AgentMessage(progress=pb.Progress(generation=generation, rank=0, step=12, samples_per_s=math.inf)),
        pb.AgentMessage(progress=pb.Progress(generation=generation, rank=0, step=12, samples_per_s=math.nan)),
        pb.AgentMessage(progress=pb.Progress(generation=generation, rank=0, step=12, samples_per_s=-1.0)),
        pb.AgentMessage(progress=pb.Progress(generation=generation, rank=0, step=-5)),
        pb.AgentMessage(progress=pb.Progress(generation=generation, rank=0, step=12, consumed_samples=1 << 62)),
        pb.AgentMessage(progress=pb.Progress(generation=generation, rank=0, step=12, epoch=-1)),
        pb.AgentMessage(bad_batch=pb.BadBatch(generation=generation, rank=0, step=12, sample_start=5, sample_end=5,
                                              reason="x")),
        pb.AgentMessage(bad_batch=pb.BadBatch(generation=generation, rank=0, step=12, sample_start=0,
                                              sample_end=1 << 62, reason="x")),
        pb.AgentMessage(bad_batch=pb.BadBatch(generation=generation, rank=0, step=12, sample_start=0, sample_end=12,
                                              reason="r" * 101)),
        pb.AgentMessage(checkpoint_saved=pb.CheckpointSaved(generation=generation, step=20, path="/ckpt/" + "p" * 5000)),
        pb.AgentMessage(checkpoint_saved=pb.CheckpointSaved(generation=generation, step=20, consumed_samples=-1,
                                                            path="/ckpt/step_00000020")),
        pb.AgentMessage(checkpoint_saved=pb.CheckpointSaved(generation=-3, step=20, path="/ckpt/step_00000020")),
        pb.AgentMessage(checkpoint_failed=pb.CheckpointFailed(generation=generation, rank=0, step=0, reason="x")),
        pb.AgentMessage(checkpoint_failed=pb.CheckpointFailed(generation=generation, rank=0, step=20, reason="")),
        pb.AgentMessage(checkpoint_failed=pb.CheckpointFailed(generation=generation, rank=-1, step=20, reason="x")),
        pb.AgentMessage(stopped=pb.Stopped(generation=-1)),
        pb.AgentMessage(log_data=pb.LogData(request_id=1, offset=-1)),
        pb.AgentMessage(log_data=pb.LogData(request_id=1, error="e" * 1001)),
    ]


def test_malformed_messages_are_dropped_and_counted_and_the_job_runs_on() -> None:
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b"))
        service = CoordinatorService(sim.coordinator)
        session = sim.agents["a"].session
        messages = malformed_messages(sim.job.record.generation)
        before = dropped("malformed")
        for message in messages:
            service._dispatch(session, message)
        assert dropped("malformed") - before == len(messages)
        await sim.tick()
        assert sim.state is JobState.RUNNING and sim.job.record.last_failure is None
        assert [(r.rank, r.step) for r in sim.job.view().ranks] == [(0, 10), (1, 10)]
        assert [c.step for c in sim.job.catalog.entries()] == [10]
        assert not session.closed.is_set()
    run(scenario())


def test_a_nan_loss_is_what_a_bad_batch_shows_and_is_kept() -> None:
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a",))
        service = CoordinatorService(sim.coordinator)
        service._dispatch(sim.agents["a"].session, pb.AgentMessage(progress=pb.Progress(
            generation=1, rank=0, step=11, loss=math.nan, grad_norm=math.inf, samples_per_s=10.0,
            consumed_samples=132)))
        view = sim.job.view()
        assert view.ranks[0].step == 11 and math.isnan(view.ranks[0].loss)
    run(scenario())


def test_a_failed_save_is_one_event_with_its_reason_and_the_job_runs_on() -> None:
    """On a full disk every rank's save of the step fails: the first report becomes a `checkpoint_failed`
    event (its reason made one line), the others add nothing, and the newest good checkpoint stays."""
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b"))
        service = CoordinatorService(sim.coordinator)
        reason = "rank 1 could not save /ckpt/step_00000020: [Errno 28] No space left on device\nforged line"
        for node, rank in (("b", 1), ("a", 0), ("b", 1)):
            service._dispatch(sim.agents[node].session, pb.AgentMessage(checkpoint_failed=pb.CheckpointFailed(
                generation=1, rank=rank, step=20, reason=reason)))
        await sim.tick()
        failed = [e for e in await sim.coordinator.events(0) if e.kind == "checkpoint_failed"]
        assert len(failed) == 1, failed
        assert failed[0].fields == {"generation": 1, "step": 20, "rank": 1, "node": "b",
                                    "reason": reason.replace("\n", "\\n")}
        assert "No space left on device" in failed[0].message and "last committed checkpoint is step 10" in \
            failed[0].message
        assert sim.state is JobState.RUNNING and [c.step for c in sim.job.catalog.entries()] == [10]
    run(scenario())


def test_an_agent_reporting_step_after_step_cannot_grow_the_leaders_memory() -> None:
    """Failed saves, commits and skipped batches are remembered per generation to drop repeats, but only
    the newest REMEMBERED_STEPS of each: the oldest are forgotten, the newest still deduplicated."""
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a",))
        service = CoordinatorService(sim.coordinator)
        session = sim.agents["a"].session
        steps = range(100, 100 + 2 * REMEMBERED_STEPS)
        for step in steps:
            service._dispatch(session, pb.AgentMessage(checkpoint_failed=pb.CheckpointFailed(
                generation=1, rank=0, step=step, reason="disk full")))
            service._dispatch(session, pb.AgentMessage(bad_batch=pb.BadBatch(
                generation=1, rank=0, step=step, sample_start=step * 12, sample_end=step * 12 + 12,
                reason="non-finite loss", loss=math.nan, grad_norm=1.0)))
        observation = sim.job.inbox.observation
        assert observation is not None
        newest = set(steps[-REMEMBERED_STEPS:])
        assert observation.failed_checkpoints == newest and set(observation.bad_batches) == newest
        assert not sim.job.inbox.take("a", CheckpointFailed(1, 0, steps[-1], "told again"))  # still a repeat
    run(scenario())


def test_an_infinite_rate_is_dropped_at_the_servicer() -> None:
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b"))
        service = CoordinatorService(sim.coordinator)
        service._dispatch(sim.agents["a"].session, pb.AgentMessage(progress=pb.Progress(
            generation=1, rank=0, step=12, samples_per_s=math.inf, consumed_samples=144)))
        assert [r.step for r in sim.job.view().ranks] == [10, 10]
        await sim.coordinator.set_drain("b", True)
        await sim.tick()
        requests = sim.agents["a"].checkpoint_requests()
        assert requests and requests[-1].step < 100  # led by the rates the ranks really reported
    run(scenario())


def test_start_up_times_out_of_bounds_drop_their_report_and_ones_within_reach_the_observation() -> None:
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b"))
        service = CoordinatorService(sim.coordinator)
        for hostile in (math.nan, -1.0, math.inf, 1e12):
            service._dispatch(sim.agents["a"].session, pb.AgentMessage(progress=pb.Progress(
                generation=1, rank=0, step=12, samples_per_s=10.0, consumed_samples=144,
                startup=pb.RankStartup(comm_setup_s=1.0, load_s=hostile, first_step_s=0.5))))
        assert [r.step for r in sim.job.view().ranks] == [10, 10] and sim.job.inbox.observation.startups == {}
        service._dispatch(sim.agents["a"].session, pb.AgentMessage(progress=pb.Progress(
            generation=1, rank=0, step=12, samples_per_s=10.0, consumed_samples=144,
            startup=pb.RankStartup(comm_setup_s=1.0, load_s=0.25, first_step_s=0.5))))
        assert sim.job.inbox.observation.startups == {0: StartupTimes(1.0, 0.25, 0.5)}
    run(scenario())


def test_sessions_beyond_max_sessions_are_refused_resource_exhausted() -> None:
    async def scenario() -> None:
        sim = SimCluster(job_settings())
        await sim.lead()
        server = grpc_server()
        port = server.add_insecure_port("127.0.0.1:0")
        pb_grpc.add_CoordinatorServicer_to_server(CoordinatorService(sim.coordinator, max_sessions=2), server)
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            stub = pb_grpc.CoordinatorStub(channel)

            async def open_session(name: str) -> grpc.aio.StreamStreamCall:
                call = stub.Session()
                await call.write(pb.AgentMessage(hello=hello(node_name=name)))
                assert (await call.read()).WhichOneof("body") == "welcome"
                return call

            first, _ = await open_session("n1"), await open_session("n2")
            third = stub.Session()
            await third.write(pb.AgentMessage(hello=hello(node_name="n3")))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await third.read()
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2 sessions, the most it allows" in refused.value.details()

            first.cancel()
            for _ in range(100):  # the server notices the cancel
                if sim.coordinator.session_count < 2:
                    break
                await asyncio.sleep(0.02)
            await open_session("n3")
        finally:
            await channel.close()
            await server.stop(None)
    run(scenario())


async def serve_sessions(service: CoordinatorService) -> tuple[grpc.aio.Server, grpc.aio.Channel]:
    """A real gRPC server carrying `service` on loopback, and a channel to it."""
    server = grpc_server()
    port = server.add_insecure_port("127.0.0.1:0")
    pb_grpc.add_CoordinatorServicer_to_server(service, server)
    await server.start()
    return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


def test_a_new_node_beyond_the_admission_queue_is_deferred_with_a_hint_and_a_known_one_is_not() -> None:
    async def scenario() -> None:
        sim = SimCluster(job_settings())
        await sim.lead()
        admission = HelloAdmission(FakeClock(), concurrent=1, max_wait_s=0.001)
        server, channel = await serve_sessions(CoordinatorService(sim.coordinator, admission=admission))
        busy = asyncio.Event()

        async def recording_elsewhere() -> None:  # another Hello holds the one place, one more waits
            async with admission.admit():
                await busy.wait()

        holders: list[asyncio.Task] = []
        try:
            stub = pb_grpc.CoordinatorStub(channel)
            first = stub.Session()
            await first.write(pb.AgentMessage(hello=hello(node_name="n0")))
            token = (await first.read()).welcome.resume_token
            holders += [asyncio.create_task(recording_elsewhere()) for _ in range(2)]
            await asyncio.sleep(0.01)
            known = stub.Session()  # n0 is READY as it was: no etcd write, no queue
            await known.write(pb.AgentMessage(hello=hello(node_name="n0", resume_token=token)))
            assert (await known.read()).WhichOneof("body") == "welcome"
            new = stub.Session()
            await new.write(pb.AgentMessage(hello=hello(node_name="newcomer")))
            with pytest.raises(grpc.aio.AioRpcError) as deferred:
                await new.read()
            assert deferred.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert retry_after_s(deferred.value) == MIN_RETRY_AFTER_S  # what the agent waits, plus jitter
            first.cancel()
            known.cancel()
        finally:
            busy.set()
            await asyncio.gather(*holders)
            await channel.close()
            await server.stop(None)
    run(scenario())


def test_past_max_opening_each_agent_is_turned_away_with_its_own_turn_and_welcomed_once_a_place_frees() -> None:
    async def scenario() -> None:
        sim = SimCluster(job_settings())
        await sim.lead()
        gate = OpeningGate(FakeClock(), max_opening=1)
        server, channel = await serve_sessions(CoordinatorService(sim.coordinator, gate=gate))
        busy = asyncio.Event()

        async def opening_elsewhere() -> None:  # another session holds the one place
            async with gate.opening_session():
                await busy.wait()

        holder = asyncio.create_task(opening_elsewhere())
        try:
            stub = pb_grpc.CoordinatorStub(channel)
            await asyncio.sleep(0.01)
            hints = []
            for name in ("n0", "n1"):
                call = stub.Session()
                await call.write(pb.AgentMessage(hello=hello(node_name=name)))
                with pytest.raises(grpc.aio.AioRpcError) as deferred:
                    await call.read()
                # the agent's own status and hint, not INTERNAL: its Hello was read before it was turned away
                assert deferred.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                hints.append(retry_after_s(deferred.value))
            assert MIN_RETRY_AFTER_S <= hints[0] < hints[1]  # each its own turn, not the same hint for all
            assert sim.coordinator.session_count == 0
            busy.set()
            await holder
            call = stub.Session()
            await call.write(pb.AgentMessage(hello=hello(node_name="n0")))
            assert (await call.read()).WhichOneof("body") == "welcome"
            call.cancel()
        finally:
            busy.set()
            await asyncio.gather(holder)
            await channel.close()
            await server.stop(None)
    run(scenario())


class LeavesAtTheWelcome:
    """A stream whose agent sent its Hello and was gone when the Welcome was written."""

    def __init__(self, message: pb.AgentMessage) -> None:
        self._message = message

    async def read(self) -> pb.AgentMessage:
        return self._message

    async def write(self, message: pb.CoordinatorMessage) -> None:
        raise asyncio.InvalidStateError("the RPC has ended")


def test_an_agent_gone_when_its_welcome_is_written_leaves_no_session_holding_its_name() -> None:
    async def scenario() -> None:
        sim = SimCluster(job_settings())
        await sim.lead()
        service = CoordinatorService(sim.coordinator)
        with pytest.raises(asyncio.InvalidStateError):
            await service._open(LeavesAtTheWelcome(pb.AgentMessage(hello=hello(node_name="n0"))))
        assert sim.coordinator.session_count == 0
        # it never got the resume token: its next Hello, without one, must not meet "held by a live session"
        await sim.connect("n0")
        assert sim.coordinator.session_count == 1
    run(scenario())


def test_a_drain_names_a_node_or_is_refused_in_one_short_line() -> None:
    async def scenario() -> None:
        sim = SimCluster(job_settings())
        await sim.lead()
        for i in range(25):
            await sim.connect(f"n{i:02d}")
        server = grpc_server()
        port = server.add_insecure_port("127.0.0.1:0")
        pb_grpc.add_ControlServicer_to_server(ControlService(sim.coordinator), server)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.ControlStub(channel)
                for node, code, details in (
                        ("x" * 300_000, grpc.StatusCode.INVALID_ARGUMENT, "is not a node name"),
                        ("bad name", grpc.StatusCode.INVALID_ARGUMENT, "'bad name' is not a node name"),
                        ("nope", grpc.StatusCode.FAILED_PRECONDITION,
                         "no node named 'nope' (known: n00, n01, n02, n03, n04, n05, n06, n07, n08, n09, n10, n11, n12, "
                         "n13, n14, n15, n16, n17, n18, n19 and 5 more)")):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await stub.SetDrain(pb.DrainRequest(node=node, drained=True), timeout=10)
                    assert refused.value.code() is code and details in refused.value.details()
                    assert len(refused.value.details()) < 300
                reply = await stub.SetDrain(pb.DrainRequest(node="n03", drained=True), timeout=10)
                assert reply.message == "node n03 is drained"
        finally:
            await server.stop(None)
    run(scenario())


async def one_welcomed_and_one_heartbeating(sim: SimCluster, quiet: str) -> tuple[
        grpc.aio.Server, grpc.aio.Channel, dict[str, grpc.aio.StreamStreamCall]]:
    """Two sessions over real gRPC, each Hello naming a next Welcome wait of 20 s: `quiet` sends nothing after
    its Welcome, "heartbeated" one heartbeat, acked."""
    server, channel = await serve_sessions(CoordinatorService(sim.coordinator))
    stub = pb_grpc.CoordinatorStub(channel)
    calls = {}
    for name in (quiet, "heartbeated"):
        calls[name] = stub.Session()
        await calls[name].write(pb.AgentMessage(hello=hello(node_name=name, next_welcome_wait_s=20.0)))
        assert (await calls[name].read()).WhichOneof("body") == "welcome"
    await calls["heartbeated"].write(pb.AgentMessage(heartbeat=pb.Heartbeat(sequence=1)))
    assert (await calls["heartbeated"].read()).WhichOneof("body") == "heartbeat_ack"
    return server, channel, calls


async def all_sessions_closed(sim: SimCluster) -> None:
    """Until the server noticed its agents' cancels."""
    for _ in range(200):
        if sim.coordinator.session_count == 0:
            return
        await asyncio.sleep(0.02)
    assert sim.coordinator.session_count == 0


async def node_states(sim: SimCluster) -> dict[str, str]:
    return {node.name: node.state.value for node in (await sim.coordinator.view()).nodes}


def test_a_node_whose_agent_left_before_confirming_its_welcome_gets_twice_its_next_welcome_wait_before_lost() -> None:
    """In a connect burst a Hello can wait in the gRPC queue until its agent gives it up, just as the
    coordinator welcomes it; the agent's next Hello then waits in the same queue. A node whose session ended
    before anything came after the Welcome gets twice the wait its Hello named on top of the grace (its next
    Hello may go to the other coordinator first); one whose agent sent a heartbeat first gets the grace
    alone."""
    async def scenario() -> None:
        sim = SimCluster(job_settings())
        await sim.lead()
        server, channel, calls = await one_welcomed_and_one_heartbeating(sim, "gave-up")
        try:
            for call in calls.values():
                call.cancel()
            await all_sessions_closed(sim)
            await sim.tick(SESSION_GRACE_S + 0.1)
            assert await node_states(sim) == {"gave-up": "READY", "heartbeated": "LOST"}
            await sim.tick(40.0 - 0.2)  # silent for 41.9 s, past the 5 s timeout: still not LOST
            assert (await node_states(sim))["gave-up"] == "READY"
            await sim.tick(0.2)
            assert (await node_states(sim))["gave-up"] == "LOST"
        finally:
            await channel.close()
            await server.stop(None)
    run(scenario())


def test_a_node_whose_agent_has_not_yet_read_its_welcome_is_not_lost_before_the_wait_its_hello_named() -> None:
    """A starved host can read its Welcome seconds after it was written (a 20,000-agent burst on 2 cores: 5.1 s,
    and the node went LOST at the 5 s timeout). While its session is open and nothing came after the Welcome,
    its silence counts only past the Welcome wait its Hello named; once it sent anything, the timeout holds."""
    async def scenario() -> None:
        sim = SimCluster(job_settings())
        await sim.lead()
        server, channel, calls = await one_welcomed_and_one_heartbeating(sim, "reads-late")
        try:
            await sim.tick(HEARTBEAT_TIMEOUT_S + 1)
            assert await node_states(sim) == {"reads-late": "READY", "heartbeated": "LOST"}
            await sim.tick(20.0 - HEARTBEAT_TIMEOUT_S - 1 - 0.1)  # 19.9 s since its Welcome
            assert (await node_states(sim))["reads-late"] == "READY"
            await sim.tick(0.2)
            assert (await node_states(sim))["reads-late"] == "LOST"
            for call in calls.values():
                call.cancel()
        finally:
            await channel.close()
            await server.stop(None)
    run(scenario())


def test_a_node_whose_agent_was_turned_away_at_the_door_is_not_lost_before_its_turn_is_over() -> None:
    """In a connect burst an agent whose session broke can be turned away with a turn further off than the
    grace. Its node has its turn (times the agent's jitter), the Welcome wait its Hello named and the grace,
    while a node whose agent did not come back is LOST after the grace."""
    async def scenario() -> None:
        sim = SimCluster(job_settings())
        await sim.lead()
        gate = OpeningGate(FakeClock(), max_opening=1)
        server, channel = await serve_sessions(CoordinatorService(sim.coordinator, gate=gate))
        stub = pb_grpc.CoordinatorStub(channel)
        busy = asyncio.Event()

        async def opening_elsewhere() -> None:  # another session holds the one place
            async with gate.opening_session():
                await busy.wait()

        holder: asyncio.Task | None = None
        try:
            for name in ("turned-away", "gone"):
                call = stub.Session()
                await call.write(pb.AgentMessage(hello=hello(node_name=name, next_welcome_wait_s=20.0)))
                assert (await call.read()).WhichOneof("body") == "welcome"
                await call.write(pb.AgentMessage(heartbeat=pb.Heartbeat(sequence=1)))
                assert (await call.read()).WhichOneof("body") == "heartbeat_ack"
                call.cancel()
            await all_sessions_closed(sim)
            holder = asyncio.create_task(opening_elsewhere())
            await asyncio.sleep(0.01)
            again = stub.Session()
            await again.write(pb.AgentMessage(hello=hello(node_name="turned-away", next_welcome_wait_s=20.0)))
            with pytest.raises(grpc.aio.AioRpcError) as deferred:
                await again.read()
            assert deferred.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            given_s = RETRY_AFTER_SPREAD * retry_after_s(deferred.value) + 20.0 + SESSION_GRACE_S

            await sim.tick(SESSION_GRACE_S + 0.1)
            assert await node_states(sim) == {"turned-away": "READY", "gone": "LOST"}
            await sim.tick(given_s - SESSION_GRACE_S - 0.3)  # past the 5 s timeout many times over
            assert (await node_states(sim))["turned-away"] == "READY"
            await sim.tick(0.4)
            assert (await node_states(sim))["turned-away"] == "LOST"
        finally:
            busy.set()
            if holder is not None:
                await holder
            await channel.close()
            await server.stop(None)
    run(scenario())


def test_a_worker_warning_is_one_job_warning_event_however_often_it_is_told(capsys: pytest.CaptureFixture[str]) -> None:
    """Each generation's rank 0 finds the same risk again (a ModelCheckpoint beside TrainerdCallback): one
    `job_warning` event of its text, made one line; a malformed one is dropped, and the job runs on."""
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b"))
        service = CoordinatorService(sim.coordinator)
        text = "Model.train's callbacks hold a ModelCheckpoint\nforged line"
        for _ in range(3):
            service._dispatch(sim.agents["a"].session, pb.AgentMessage(worker_warning=pb.WorkerWarning(
                generation=1, rank=0, step=0, text=text)))
        before = dropped("malformed")
        service._dispatch(sim.agents["a"].session, pb.AgentMessage(worker_warning=pb.WorkerWarning(
            generation=1, rank=0, step=0, text="")))
        assert dropped("malformed") - before == 1
        assert not sim.job.inbox.take("b", WorkerWarned(1, 0, "rank 0 runs on node a"))  # not placed there: dropped
        await sim.tick()
        warnings = [e for e in await sim.coordinator.events(0) if e.kind == "job_warning"]
        assert [(e.message, e.fields) for e in warnings] == [
            (f"job {sim.job.spec.name}: {text.replace(chr(10), chr(92) + 'n')}", {"generation": 1, "rank": 0, "node": "a"})]
        assert sim.state is JobState.RUNNING
        shown = status_to_json(pb.StatusReply(job=job_to_proto(sim.job.view())))["job"]
        assert shown["warnings"] == [text.replace(chr(10), chr(92) + "n")]
        print_status(status_to_json(pb.StatusReply(job=job_to_proto(sim.job.view()))))
        assert "warning: Model.train's callbacks hold a ModelCheckpoint\\nforged line" in capsys.readouterr().out
    run(scenario())


def test_a_heartbeat_with_a_field_out_of_bounds_is_acked_and_only_that_field_is_dropped() -> None:
    """Issue 47: a generation resumed at step 2**62 made every honest heartbeat malformed (its processes'
    steps passed the bound); each was dropped whole and never acked, so the agents redialled every 3 s and
    the job stayed RECOVERING. Over real gRPC: a heartbeat with one bad status, a step past the checkpoint
    format's 2**48 and a bad snapshot claim is acked, and its good status still counts."""
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a",))
        sim.disconnect("a")  # its agent comes back over gRPC, within the session grace
        server, channel = await serve_sessions(CoordinatorService(sim.coordinator))
        try:
            call = pb_grpc.CoordinatorStub(channel).Session()
            await call.write(pb.AgentMessage(hello=hello(node_name="a")))
            assert (await call.read()).WhichOneof("body") == "welcome"
            before = dropped("malformed")
            await call.write(pb.AgentMessage(heartbeat=pb.Heartbeat(sequence=7, generation=1, processes=[
                pb.ProcessStatus(role="worker", rank=0, pid=200, state=pb.PROCESS_EXITED, exit_code=1),
                pb.ProcessStatus(role="scheduler", rank=-1, pid=100, state=pb.PROCESS_RUNNING, step=1 << 62),
            ], held_snapshots=[pb.MemorySnapshot(step=1 << 62, ranks=[0], world_size=1, generation=1)])))
            reply = await call.read()
            assert reply.WhichOneof("body") == "heartbeat_ack" and reply.heartbeat_ack.sequence == 7
            assert dropped("malformed") - before == 2
            await sim.tick()
            assert sim.job.record.last_failure is not None and sim.job.record.last_failure.rank == 0
            call.cancel()
        finally:
            await channel.close()
            await server.stop(None)
    run(scenario())


def test_peer_text_is_escaped_before_it_is_logged_stored_or_printed(caplog) -> None:
    """Issue 47: a node check's detail and a log tail reached the log and `trainerctl events` raw: a newline
    forged a log line, an OSC escape retitled the terminal. They are escaped at the servicer."""
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b"), min_nodes=2, max_nodes=2, node_check=["{python}", "check.py"])
        sim.disconnect("b")
        await sim.tick(SESSION_GRACE_S + 1)
        agent = await sim.connect("b")  # back from LOST: it runs the node check
        service = CoordinatorService(sim.coordinator)
        [check] = [c for c in agent.commands if isinstance(c, NodeCheckCommand)]
        service._dispatch(agent.session, pb.AgentMessage(node_check_result=pb.NodeCheckResult(
            check_id=check.check_id, passed=False, detail="bad disk\nI1207 forged line \x1b]0;owned\x07")))
        await asyncio.sleep(0.05)
        [failed] = [e for e in await sim.coordinator.events(0) if e.kind == "node_check_failed"]
        assert failed.fields["reason"] == "bad disk\\nI1207 forged line \\x1b]0;owned\\x07"
        assert failed.message.isprintable()
        assert all(r.getMessage().isprintable() for r in caplog.records)
    run(scenario())
