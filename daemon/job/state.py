"""The job's durable state (`jobs/{job}/status`, `jobs/{job}/generations/{g}`) and its legal moves."""

from __future__ import annotations

from dataclasses import dataclass, replace

from daemon.job.placement import Placement
from proto.vocabulary import JobState

# Every write of the job state is checked against this table (DESIGN.md, "reconcile loop").
ALLOWED_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.RUNNING, JobState.WAITING, JobState.FAILED, JobState.PAUSED,
                                 JobState.COMPLETED}),
    JobState.RUNNING: frozenset({JobState.RECOVERING, JobState.COMPLETED, JobState.FAILED, JobState.PAUSED,
                                 JobState.WAITING}),
    JobState.RECOVERING: frozenset({JobState.RUNNING, JobState.WAITING, JobState.FAILED, JobState.PAUSED,
                                    JobState.COMPLETED}),
    JobState.WAITING: frozenset({JobState.RECOVERING, JobState.PENDING, JobState.FAILED, JobState.PAUSED}),
    JobState.PAUSED: frozenset({JobState.RECOVERING, JobState.PENDING}),
    JobState.FAILED: frozenset({JobState.RECOVERING, JobState.PENDING}),
    JobState.COMPLETED: frozenset(),
}


class IllegalTransition(Exception):
    pass


@dataclass(frozen=True)
class Failure:
    """Why a generation ended badly: what a user reads in `status` and in the events."""

    cause: str  # process_exited, node_lost, launch_failed, hang
    message: str
    node: str = ""
    rank: int = -1
    exit_code: int = 0
    signal: int = 0

    def to_json(self) -> dict:
        return {"cause": self.cause, "message": self.message, "node": self.node, "rank": self.rank,
                "exit_code": self.exit_code, "signal": self.signal}

    @classmethod
    def from_json(cls, data: dict) -> "Failure":
        return cls(str(data["cause"]), str(data["message"]), str(data.get("node", "")),
                   int(data.get("rank", -1)), int(data.get("exit_code", 0)), int(data.get("signal", 0)))


@dataclass(frozen=True)
class JobRecord:
    state: JobState
    generation: int = 0
    world_size: int = 0
    restarts: int = 0
    last_failure: Failure | None = None

    def moved_to(self, state: JobState, **changes) -> "JobRecord":
        if state is not self.state and state not in ALLOWED_TRANSITIONS[self.state]:
            raise IllegalTransition(f"job cannot go from {self.state.value} to {state.value}")
        return replace(self, state=state, **changes)

    def to_json(self) -> dict:
        return {"state": self.state.value, "generation": self.generation, "world_size": self.world_size,
                "restarts": self.restarts,
                "last_failure": None if self.last_failure is None else self.last_failure.to_json()}

    @classmethod
    def from_json(cls, data: dict) -> "JobRecord":
        failure = data.get("last_failure")
        return cls(JobState(data["state"]), int(data["generation"]), int(data["world_size"]),
                   int(data["restarts"]), None if failure is None else Failure.from_json(failure))


@dataclass(frozen=True)
class GenerationRecord:
    """A launched generation: decided once, committed to etcd before any Launch is sent."""

    number: int
    placement: Placement
    scheduler_port: int
    rank_table_json: str

    def to_json(self) -> dict:
        return {"number": self.number, "placement": self.placement.to_json(),
                "scheduler_port": self.scheduler_port, "rank_table": self.rank_table_json}

    @classmethod
    def from_json(cls, data: dict) -> "GenerationRecord":
        return cls(int(data["number"]), Placement.from_json(data["placement"]), int(data["scheduler_port"]),
                   str(data["rank_table"]))
