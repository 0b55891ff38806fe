"""The coordinator's commands to this agent, as the agent's own values.

The session (agent/session.py) converts each CoordinatorMessage it reads with `command_from`, one function
per message here, so nothing past it handles protobuf: the supervisor, the launch policy, the node check and
the snapshot keeper take these. Every field is named as in proto/trainerd.proto and defaults as proto3 does;
repeated fields are tuples, a message field that may be unset is None.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from proto import trainerd_pb2 as pb


@dataclass(frozen=True)
class ProcessSpec:
    role: str = ""  # "scheduler" or "worker"
    rank: int = 0  # -1 for the scheduler
    local_rank: int = 0
    device_id: int = 0
    argv: tuple[str, ...] = ()  # "{python}" stands for the agent's interpreter
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SampleRange:
    start: int = 0  # inclusive
    end: int = 0  # exclusive


@dataclass(frozen=True)
class PeerAgent:
    """Another node's agent and its SnapshotPeer service."""

    node: str = ""
    address: str = ""  # host:port


@dataclass(frozen=True)
class SnapshotSource:
    rank: int = 0
    holder: PeerAgent = PeerAgent()


@dataclass(frozen=True)
class Launch:
    generation: int = 0
    job_name: str = ""
    processes: tuple[ProcessSpec, ...] = ()
    rank_table_json: str = ""
    checkpoint_path: str = ""  # empty: start fresh
    skips: tuple[SampleRange, ...] = ()
    workdir: str = ""  # empty: the agent's per-job default
    graceful_exit_file: str = ""
    progress_pattern: str = ""  # empty: MindSpore's
    snapshot_sources: tuple[SnapshotSource, ...] = ()
    copy_from: PeerAgent | None = None  # None: copy no other node's snapshots
    peer_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Standby:
    """This node is a spare of the job's running generation: prepare what its processes would be forked from."""

    generation: int = 0
    job_name: str = ""
    processes: tuple[ProcessSpec, ...] = ()
    workdir: str = ""  # empty: the agent's per-job default


@dataclass(frozen=True)
class Stop:
    generation: int = 0
    grace_s: float = 0.0
    reason: str = ""
    dump_stacks: bool = False
    job_completed: bool = False


@dataclass(frozen=True)
class RequestExit:
    generation: int = 0


@dataclass(frozen=True)
class ReadLog:
    request_id: int = 0
    generation: int = 0
    role: str = ""
    rank: int = 0
    offset: int = 0  # negative: that many bytes before the end
    max_bytes: int = 0


@dataclass(frozen=True)
class CheckpointNow:
    generation: int = 0
    step: int = 0


@dataclass(frozen=True)
class NodeCheck:
    check_id: int = 0
    argv: tuple[str, ...] = ()  # "{python}" stands for the agent's interpreter
    timeout_s: float = 0.0


@dataclass(frozen=True)
class Revocations:
    serials: frozenset[str] = frozenset()


@dataclass(frozen=True)
class NodeCertificate:
    certificate_pem: bytes = b""


Command = Launch | Standby | Stop | RequestExit | ReadLog | CheckpointNow | NodeCheck | Revocations | NodeCertificate


def process_spec_from(spec: pb.ProcessSpec) -> ProcessSpec:
    return ProcessSpec(role=spec.role, rank=spec.rank, local_rank=spec.local_rank, device_id=spec.device_id,
                       argv=tuple(spec.argv), env=dict(spec.env))


def sample_range_from(sample_range: pb.SampleRange) -> SampleRange:
    return SampleRange(start=sample_range.start, end=sample_range.end)


def peer_agent_from(peer: pb.PeerAgent) -> PeerAgent:
    return PeerAgent(node=peer.node, address=peer.address)


def snapshot_source_from(source: pb.SnapshotSource) -> SnapshotSource:
    return SnapshotSource(rank=source.rank, holder=peer_agent_from(source.holder))


def launch_from(launch: pb.Launch) -> Launch:
    return Launch(
        generation=launch.generation, job_name=launch.job_name,
        processes=tuple(process_spec_from(spec) for spec in launch.processes),
        rank_table_json=launch.rank_table_json, checkpoint_path=launch.checkpoint_path,
        skips=tuple(sample_range_from(skip) for skip in launch.skips), workdir=launch.workdir,
        graceful_exit_file=launch.graceful_exit_file, progress_pattern=launch.progress_pattern,
        snapshot_sources=tuple(snapshot_source_from(source) for source in launch.snapshot_sources),
        copy_from=peer_agent_from(launch.copy_from) if launch.HasField("copy_from") else None,
        peer_nodes=tuple(launch.peer_nodes))


def standby_from(standby: pb.Standby) -> Standby:
    return Standby(generation=standby.generation, job_name=standby.job_name,
                   processes=tuple(process_spec_from(spec) for spec in standby.processes), workdir=standby.workdir)


def stop_from(stop: pb.Stop) -> Stop:
    return Stop(generation=stop.generation, grace_s=stop.grace_s, reason=stop.reason, dump_stacks=stop.dump_stacks,
                job_completed=stop.job_completed)


def request_exit_from(request: pb.RequestExit) -> RequestExit:
    return RequestExit(generation=request.generation)


def read_log_from(request: pb.ReadLog) -> ReadLog:
    return ReadLog(request_id=request.request_id, generation=request.generation, role=request.role,
                   rank=request.rank, offset=request.offset, max_bytes=request.max_bytes)


def checkpoint_now_from(request: pb.CheckpointNow) -> CheckpointNow:
    return CheckpointNow(generation=request.generation, step=request.step)


def node_check_from(check: pb.NodeCheck) -> NodeCheck:
    return NodeCheck(check_id=check.check_id, argv=tuple(check.argv), timeout_s=check.timeout_s)


def revocations_from(revocations: pb.Revocations) -> Revocations:
    return Revocations(serials=frozenset(revocations.serials))


def node_certificate_from(certificate: pb.NodeCertificate) -> NodeCertificate:
    return NodeCertificate(certificate_pem=certificate.certificate_pem)


# What each body of a CoordinatorMessage that is a command becomes; Welcome and HeartbeatAck are the session's own.
_CONVERTERS: dict[str, Callable] = {
    "launch": launch_from,
    "standby": standby_from,
    "stop": stop_from,
    "request_exit": request_exit_from,
    "read_log": read_log_from,
    "checkpoint_now": checkpoint_now_from,
    "node_check": node_check_from,
    "revocations": revocations_from,
    "node_certificate": node_certificate_from,
}


def command_from(message: pb.CoordinatorMessage) -> Command | None:
    """The command `message` carries, or None when it carries none (a Welcome after the session's first, an
    empty body, a kind this agent does not know)."""
    kind = message.WhichOneof("body")
    converter = _CONVERTERS.get(kind or "")
    return None if converter is None else converter(getattr(message, kind))
