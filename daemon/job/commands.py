"""Commands the coordinator sends to an agent, as plain values (the servicer turns them into protobuf)."""

from __future__ import annotations

from dataclasses import dataclass

from daemon.job.launch_plan import ProcessPlan
from daemon.job.state import SnapshotHolder


@dataclass(frozen=True)
class LaunchCommand:
    generation: int
    job_name: str
    processes: tuple[ProcessPlan, ...]
    rank_table_json: str
    checkpoint_path: str  # empty: from scratch
    skips: tuple[tuple[int, int], ...]  # the skip ledger's ranges when the generation was launched
    workdir: str = ""  # empty: the agent's per-job default
    graceful_exit_file: str = ""  # the script's OnRequestExit file, relative to workdir; empty: none
    progress_pattern: str = ""  # empty: MindSpore's LossMonitor/TimeMonitor lines
    # Resuming from an in-memory snapshot that spanned hosts: each rank's holder (node, SnapshotPeer address).
    snapshot_sources: tuple[SnapshotHolder, ...] = ()
    copy_from: tuple[str, str] | None = None  # the ring predecessor whose snapshots this node copies: node, address
    # The generation's nodes: the only ones whose certificates this node's SnapshotPeer serves while it runs it.
    peer_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class StopCommand:
    generation: int
    grace_s: float
    reason: str
    dump_stacks: bool = False  # a hang: every process's Python stack goes into its log before the kill
    job_completed: bool = False  # the agents drop the job's in-memory snapshots


@dataclass(frozen=True)
class StandbyCommand:
    """A spare of the running generation: start what its processes would be forked from, and nothing else."""

    generation: int
    job_name: str
    processes: tuple[ProcessPlan, ...]  # the workers it would run on its devices
    workdir: str = ""  # empty: the agent's per-job default


@dataclass(frozen=True)
class CheckpointNowCommand:
    generation: int
    step: int


@dataclass(frozen=True)
class RequestExitCommand:
    """Stop at the next step boundary through the script's own graceful exit (MindSpore OnRequestExit)."""

    generation: int


@dataclass(frozen=True)
class ReadLogCommand:
    request_id: int
    generation: int
    role: str
    rank: int
    offset: int  # negative: that many bytes before the end
    max_bytes: int
