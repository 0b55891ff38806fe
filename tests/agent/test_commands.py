"""The coordinator's commands as the agent's own values (agent/commands.py): each field as the wire had it."""

from __future__ import annotations

import dataclasses

import pytest

from agent import commands
from agent.commands import (
    CheckpointNow,
    Launch,
    NodeCertificate,
    NodeCheck,
    PeerAgent,
    ProcessSpec,
    ReadLog,
    RequestExit,
    Revocations,
    SampleRange,
    SnapshotSource,
    Standby,
    Stop,
    command_from,
)
from proto import trainerd_pb2 as pb

# Each command's message, and the messages inside a Launch: the dataclass names every field of its message.
MESSAGES = [
    (pb.Launch, Launch), (pb.ProcessSpec, ProcessSpec), (pb.SampleRange, SampleRange), (pb.PeerAgent, PeerAgent),
    (pb.SnapshotSource, SnapshotSource), (pb.Stop, Stop), (pb.RequestExit, RequestExit), (pb.ReadLog, ReadLog),
    (pb.CheckpointNow, CheckpointNow), (pb.NodeCheck, NodeCheck), (pb.Revocations, Revocations),
    (pb.NodeCertificate, NodeCertificate), (pb.Standby, Standby),
]


@pytest.mark.parametrize(("message", "command"), MESSAGES, ids=lambda kind: kind.__name__)
def test_every_field_of_the_message_has_its_namesake(message, command) -> None:
    assert [f.name for f in message.DESCRIPTOR.fields] == [f.name for f in dataclasses.fields(command)]


def test_every_body_of_a_coordinator_message_but_the_sessions_own_is_a_command() -> None:
    not_commands = set()
    for body in pb.CoordinatorMessage.DESCRIPTOR.oneofs_by_name["body"].fields:
        message = pb.CoordinatorMessage()
        getattr(message, body.name).SetInParent()
        if command_from(message) is None:
            not_commands.add(body.name)
    assert not_commands == {"welcome", "heartbeat_ack"}  # agent/session.py handles them


def test_a_launch_converts_field_for_field() -> None:
    message = pb.Launch(
        generation=4, job_name="job", rank_table_json="{}", checkpoint_path="/ckpt/step_10", workdir="/work",
        graceful_exit_file="exit.json", progress_pattern=r"step (?P<step>\d+)",
        processes=[pb.ProcessSpec(role="worker", rank=1, local_rank=1, device_id=3, argv=["{python}", "train.py"],
                                  env={"RANK_ID": "1"})],
        skips=[pb.SampleRange(start=5, end=9)],
        snapshot_sources=[pb.SnapshotSource(rank=0, holder=pb.PeerAgent(node="h0", address="10.0.0.1:7000"))],
        copy_from=pb.PeerAgent(node="h2", address="10.0.0.2:7000"), peer_nodes=["h0", "h1", "h2"])
    assert command_from(pb.CoordinatorMessage(launch=message)) == Launch(
        generation=4, job_name="job", rank_table_json="{}", checkpoint_path="/ckpt/step_10", workdir="/work",
        graceful_exit_file="exit.json", progress_pattern=r"step (?P<step>\d+)",
        processes=(ProcessSpec(role="worker", rank=1, local_rank=1, device_id=3, argv=("{python}", "train.py"),
                               env={"RANK_ID": "1"}),),
        skips=(SampleRange(start=5, end=9),),
        snapshot_sources=(SnapshotSource(rank=0, holder=PeerAgent(node="h0", address="10.0.0.1:7000")),),
        copy_from=PeerAgent(node="h2", address="10.0.0.2:7000"), peer_nodes=("h0", "h1", "h2"))


def test_a_standby_the_coordinator_sends_converts_field_for_field() -> None:
    from daemon.grpc_services import command_to_proto
    from daemon.job.commands import StandbyCommand
    from daemon.job.launch_plan import ProcessPlan
    from proto.vocabulary import ProcessRole

    sent = StandbyCommand(3, "job", (ProcessPlan(ProcessRole.WORKER, -1, 0, 2, ("{python}", "train.py"),
                                                 {"DEVICE_ID": "2"}),), workdir="/work")
    assert command_from(command_to_proto(sent)) == Standby(
        generation=3, job_name="job", workdir="/work", processes=(
            ProcessSpec(role="worker", rank=-1, local_rank=0, device_id=2, argv=("{python}", "train.py"),
                        env={"DEVICE_ID": "2"}),))


def test_a_launch_naming_no_node_to_copy_from_has_none() -> None:
    """Unset is not an empty PeerAgent: the keeper starts no copier (agent/snapshots/snapshot_keeper.py)."""
    converted = command_from(pb.CoordinatorMessage(launch=pb.Launch(generation=1)))
    assert isinstance(converted, Launch) and converted.copy_from is None


@pytest.mark.parametrize(("message", "command"), [
    (pb.CoordinatorMessage(stop=pb.Stop(generation=2, grace_s=5.0, reason="hang", dump_stacks=True,
                                        job_completed=True)),
     Stop(generation=2, grace_s=5.0, reason="hang", dump_stacks=True, job_completed=True)),
    (pb.CoordinatorMessage(request_exit=pb.RequestExit(generation=3)), RequestExit(generation=3)),
    (pb.CoordinatorMessage(read_log=pb.ReadLog(request_id=7, generation=1, role="worker", rank=2, offset=-100,
                                               max_bytes=50)),
     ReadLog(request_id=7, generation=1, role="worker", rank=2, offset=-100, max_bytes=50)),
    (pb.CoordinatorMessage(checkpoint_now=pb.CheckpointNow(generation=1, step=40)), CheckpointNow(generation=1, step=40)),
    (pb.CoordinatorMessage(node_check=pb.NodeCheck(check_id=9, argv=["{python}", "check.py"], timeout_s=30)),
     NodeCheck(check_id=9, argv=("{python}", "check.py"), timeout_s=30)),
    (pb.CoordinatorMessage(revocations=pb.Revocations(serials=["0a", "0b"])), Revocations(frozenset({"0a", "0b"}))),
    (pb.CoordinatorMessage(node_certificate=pb.NodeCertificate(certificate_pem=b"PEM")), NodeCertificate(b"PEM")),
], ids=lambda value: type(value).__name__)
def test_each_command_converts(message: pb.CoordinatorMessage, command: commands.Command) -> None:
    assert command_from(message) == command


@pytest.mark.parametrize("message", [
    pb.CoordinatorMessage(), pb.CoordinatorMessage(welcome=pb.Welcome(node_name="n1")),
    pb.CoordinatorMessage(heartbeat_ack=pb.HeartbeatAck(sequence=1)),
], ids=["empty", "welcome", "heartbeat_ack"])
def test_what_is_no_command_converts_to_none(message: pb.CoordinatorMessage) -> None:
    assert command_from(message) is None
