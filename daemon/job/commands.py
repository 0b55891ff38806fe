"""Commands the coordinator sends to an agent, as plain values (the servicer turns them into protobuf)."""

from __future__ import annotations

from dataclasses import dataclass

from daemon.job.launch_plan import ProcessPlan


@dataclass(frozen=True)
class LaunchCommand:
    generation: int
    job_name: str
    processes: tuple[ProcessPlan, ...]
    rank_table_json: str
    checkpoint_path: str  # empty: from scratch
    skips: tuple[tuple[int, int], ...]  # the skip ledger's ranges when the generation was launched


@dataclass(frozen=True)
class StopCommand:
    generation: int
    grace_s: float
    reason: str


@dataclass(frozen=True)
class CheckpointNowCommand:
    generation: int
    step: int
