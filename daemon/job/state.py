"""The job's durable state (`jobs/{job}/status`, `jobs/{job}/generations/{g}`) and its legal moves."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from enum import StrEnum

from daemon.errors import PermanentError
from daemon.job.placement import Placement
from proto.vocabulary import CauseKind, JobState

# Every write of the job state is checked against this table (docs/concepts/reconcile-loop.md).
ALLOWED_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.RUNNING, JobState.RECOVERING, JobState.FAILED, JobState.PAUSED,
                                 JobState.COMPLETED}),
    JobState.RUNNING: frozenset({JobState.RECOVERING, JobState.COMPLETED, JobState.FAILED, JobState.PAUSED}),
    JobState.RECOVERING: frozenset({JobState.RUNNING, JobState.WAITING, JobState.FAILED, JobState.PAUSED,
                                    JobState.COMPLETED}),
    JobState.WAITING: frozenset({JobState.RECOVERING, JobState.FAILED, JobState.PAUSED}),
    JobState.PAUSED: frozenset({JobState.RECOVERING, JobState.PENDING}),
    JobState.FAILED: frozenset({JobState.RECOVERING, JobState.PENDING}),
    JobState.COMPLETED: frozenset({JobState.RECOVERING, JobState.PENDING}),  # only when the job was changed
}


class IllegalTransition(PermanentError):
    """A move the transition table forbids: a bug in the decision that asked for it, never retried."""


_NUMBER = re.compile(r"0x[0-9a-fA-F]+|\d+")


def error_key(message: str, location: str, kind: str) -> tuple[str, str]:
    """What makes two failures the same error (a job's fault, not a node's): the same location, and the
    same message, where a Python exception's numbers are ignored: ranks, sizes and shard names differ
    between ranks that hit the same line (rank 1's 'data/shard-1.bin' and rank 3's 'data/shard-3.bin'
    are the same missing data). A MindSpore error or a last line (`kind`, RootCause.kind) is compared
    whole: those mostly follow another rank's failure (a collective that broke, "The node: 3 is timed
    out at 0x7f…"), and what differs in them says which peer and which process."""
    return (_NUMBER.sub("#", message) if kind == CauseKind.PYTHON_EXCEPTION else message), location


# What a failed collective, or the connection under it, leaves as a rank's root cause: MindSpore's collective
# kernels and their ring ("Ring ReduceScatter wait receiving [1,1] failed", "Reduce wait receiving [const pair]
# failed", "Launch kernel failed: Default/AllReduce-op28", "AllReduceCPUKernelMod launch failed"), its cluster
# topology ("The node: 1 is timed out"), the collective libraries (mccl, HCCL, NCCL), timeouts, and refused,
# reset or broken connections.
_COMMUNICATION = re.compile(
    r"\bwait (?:sending|receiving)\b"
    r"|Launch kernel failed: \S*(?:All ?Reduce|All ?Gather|Reduce ?Scatter|Broadcast|All ?To ?All|Barrier|Send|Receive"
    r"|Recv)"
    r"|(?:AllReduce|AllGather|ReduceScatter|Broadcast|AllToAll|AlltoAll|Barrier|Send|Recv|Receive)\w*KernelMod"
    r"|\b[mhn]ccl|\btim(?:ed|es) out\b|\bTimeoutError\b|\b(?:receive|send|wait|socket|connect|operation) timeout\b"
    r"|\bConnection(?:Refused|Reset|Aborted)?Error\b|BrokenPipeError"
    r"|\bconnection (?:refused|reset|aborted|closed)|\bbroken pipe\b|\bmeta server\b",
    re.IGNORECASE)
_COMMUNICATION_LOCATION = re.compile(r"mindspore/ccsrc/(?:cluster|distributed)/|/collective/|_collective_|[mhn]ccl",
                                     re.IGNORECASE)


def communication_error(message: str, location: str) -> bool:
    """Whether a root cause is a collective or a communication failing (see _COMMUNICATION): a peer that
    never came or went away, a slow peer, a network that broke. It can always be the cluster's, so it is
    never taken for the job's own error (decide.py), and the rank that raised it only waited."""
    return bool(_COMMUNICATION.search(message) or _COMMUNICATION_LOCATION.search(location))


class FailureCause(StrEnum):
    """Why a generation ended badly. The value is what etcd, the events and the wire carry."""

    PROCESS_EXITED = "process_exited"  # a worker or the scheduler died
    NODE_LOST = "node_lost"  # a node's session broke, or it went silent
    # A node's agent came back running none of the generation's processes: it restarted (with trainerd, for
    # its local agents) and the processes died with it, though the node itself is back
    PROCESSES_GONE = "processes_gone"
    # A node's agent stopped the generation's processes itself: it heard no coordinator for the heartbeat
    # timeout (a coordinator down, a cut link), and fenced them so that they train no further in a world
    # that may have moved on without the node
    FENCED = "fenced"
    HANG = "hang"  # no rank made progress for hang_timeout_s
    CHECKPOINT_UNREADABLE = "checkpoint_unreadable"  # the chosen checkpoint failed to load
    USAGE_ERROR = "usage_error"  # a worker exited with EXIT_USAGE
    LAUNCH_FAILED = "launch_failed"  # the entrypoint could not be executed
    BAD_BATCHES = "bad_batches"  # too many consecutive steps skipped as bad
    # The ranks failed with the same error two generations in a row (before any progress, or after it), or
    # before any progress with an error no relaunch can pass (a SyntaxError, an ImportError of the job's
    # code), or one rank's error followed it to another node: the job is broken
    JOB_ERROR = "job_error"
    BAD_DATA = "bad_data"  # more of the samples skipped as bad than data_skip.max_skipped_fraction
    # A node's devices computed restart.quarantine_after steps otherwise when they were replayed, within
    # DEVICE_SUSPICION_WINDOW_S: the node is quarantined, and the job goes on without it
    DEVICE_FAULT = "device_fault"

    @property
    def spends_budget(self) -> bool:
        """Crashes spend the restart budget; a node leaving does not (docs/concepts/recovery.md), nor
        what fails the job at once (`permanent`): no restart follows to spend it on."""
        return not self.permanent and self not in (FailureCause.NODE_LOST, FailureCause.PROCESSES_GONE,
                                                   FailureCause.FENCED, FailureCause.DEVICE_FAULT)

    @property
    def permanent(self) -> bool:
        """The entrypoint cannot be executed, a worker refused its flags or launch environment, or
        the job's own code or data fails the same way on every rank, or so much of its data was skipped
        as bad that the data or the model must be broken: relaunching the same thing cannot help."""
        return self in (FailureCause.LAUNCH_FAILED, FailureCause.USAGE_ERROR, FailureCause.JOB_ERROR,
                        FailureCause.BAD_DATA)


@dataclass(frozen=True)
class Failure:
    """Why a generation ended badly: what a user reads in `status` and in the events."""

    cause: FailureCause
    message: str
    node: str = ""
    rank: int = -1
    exit_code: int = 0
    signal: int = 0
    location: str = ""  # "file:line" of the root cause, when the failed process's output had one
    error: str = ""  # the root cause's own line (the exception), without who raised it
    # The worker ranks that failed with this same error (message and location) in the generation: two
    # or more mean the job's own code, not a node (decide.py, _same_error_again).
    same_error_ranks: tuple[int, ...] = ()
    # Where the samples of the step the rank failed on began (-1: unknown, e.g. steps read from output).
    samples_at: int = -1
    # The node this rank's error was counted against (for the quarantine), and in how many generations in
    # a row; "" and 0 when it was counted against none (decide.py, _with_history).
    blamed_node: str = ""
    blamed: int = 0
    error_kind: str = ""  # the root cause's kind (RootCause.kind)
    # Every rank that failed met this same error, which may yet pass (decide.py, _job_error): the generation
    # is relaunched once to tell, spending no restart budget; the same error again fails the job.
    free_retry: bool = False

    @property
    def error_key(self) -> tuple[str, str]:
        return error_key(self.error, self.location, self.error_kind)

    @property
    def communication(self) -> bool:
        """The error is a collective or a connection failing: never the job's own (communication_error)."""
        return communication_error(self.error, self.location)

    @property
    def spends_budget(self) -> bool:
        return self.cause.spends_budget and not self.free_retry

    def to_json(self) -> dict:
        return {"cause": self.cause.value, "message": self.message, "node": self.node, "rank": self.rank,
                "exit_code": self.exit_code, "signal": self.signal, "location": self.location,
                "error": self.error, "same_error_ranks": list(self.same_error_ranks),
                "samples_at": self.samples_at, "blamed_node": self.blamed_node, "blamed": self.blamed,
                "error_kind": self.error_kind, "free_retry": self.free_retry}

    @classmethod
    def from_json(cls, data: dict) -> "Failure":
        """Raises ValueError for a cause this trainerd does not know (it is never guessed)."""
        return cls(FailureCause(data["cause"]), str(data["message"]), str(data.get("node", "")),
                   int(data.get("rank", -1)), int(data.get("exit_code", 0)), int(data.get("signal", 0)),
                   str(data.get("location", "")), str(data.get("error", "")),
                   tuple(int(rank) for rank in data.get("same_error_ranks", ())),
                   int(data.get("samples_at", -1)), str(data.get("blamed_node", "")),
                   int(data.get("blamed", 0)), str(data.get("error_kind", "")), data.get("free_retry") is True)


@dataclass(frozen=True)
class JobRecord:
    """`jobs/{job}/status`: everything a newly elected leader needs to carry the job on.

    `stopped_generation` is the newest generation whose stop was decided: while it is below
    `generation` that generation is live; once equal, the job is between generations.
    """

    state: JobState
    generation: int = 0
    world_size: int = 0
    restarts: int = 0  # every relaunch after the first launch
    last_failure: Failure | None = None
    stopped_generation: int = 0
    crash_restarts: int = 0  # relaunches that spent the budget (job.restart.max)
    consecutive_crashes: int = 0  # since the last checkpoint committed: sets the backoff
    node_failures: dict[str, int] = field(default_factory=dict, hash=False)  # crashes per node
    crash_steps: dict[int, int] = field(default_factory=dict, hash=False)  # crashes per failing step
    resume_from_step: int | None = None  # the operator's `resume --from-step`, for the next launch
    # The generation asked to leave through the script's graceful exit for a reshape: its ranks'
    # clean exits end it for the reshape, they do not complete the job (also after a takeover).
    exit_requested_generation: int = 0
    # The generation an operator asked to pause: it saves a checkpoint (or leaves through the graceful
    # exit) first, and the job is PAUSED once it has, or once the wait for it is over (also after a takeover).
    pause_requested_generation: int = 0
    # The generation that last became RUNNING reported its steps only in its output (an unmodified script,
    # which resumes from its own checkpoints if it keeps any): a new leader cannot tell from its own reports.
    steps_from_output: bool = False

    def moved_to(self, state: JobState, **changes) -> "JobRecord":
        if state is not self.state and state not in ALLOWED_TRANSITIONS[self.state]:
            raise IllegalTransition(f"job cannot go from {self.state.value} to {state.value}")
        return replace(self, state=state, **changes)

    @property
    def between_generations(self) -> bool:
        return self.stopped_generation >= self.generation

    @property
    def pausing(self) -> bool:
        """Asked to pause, and its generation is still saving or leaving first."""
        return self.pause_requested_generation == self.generation > 0 and self.state is not JobState.PAUSED

    def quarantined(self, quarantine_after: int) -> frozenset[str]:
        return frozenset(node for node, count in self.node_failures.items() if count >= quarantine_after)

    def to_json(self) -> dict:
        return {"state": self.state.value, "generation": self.generation, "world_size": self.world_size,
                "restarts": self.restarts,
                "last_failure": None if self.last_failure is None else self.last_failure.to_json(),
                "stopped_generation": self.stopped_generation, "crash_restarts": self.crash_restarts,
                "consecutive_crashes": self.consecutive_crashes, "node_failures": dict(self.node_failures),
                "crash_steps": {str(step): count for step, count in self.crash_steps.items()},
                "resume_from_step": self.resume_from_step,
                "exit_requested_generation": self.exit_requested_generation,
                "pause_requested_generation": self.pause_requested_generation,
                "steps_from_output": self.steps_from_output}

    @classmethod
    def from_json(cls, data: dict) -> "JobRecord":
        failure = data.get("last_failure")
        resume_from = data.get("resume_from_step")
        return cls(JobState(data["state"]), int(data["generation"]), int(data["world_size"]),
                   int(data["restarts"]), None if failure is None else Failure.from_json(failure),
                   int(data.get("stopped_generation", 0)), int(data.get("crash_restarts", 0)),
                   int(data.get("consecutive_crashes", 0)),
                   {str(k): int(v) for k, v in data.get("node_failures", {}).items()},
                   {int(k): int(v) for k, v in data.get("crash_steps", {}).items()},
                   None if resume_from is None else int(resume_from), int(data.get("exit_requested_generation", 0)),
                   int(data.get("pause_requested_generation", 0)), data.get("steps_from_output") is True)


class ResumeSource(StrEnum):
    DISK = "disk"  # a checkpoint of the catalog, at `path`
    MEMORY = "memory"  # an in-memory snapshot the generation's agents hold (no path: each agent knows its own)


@dataclass(frozen=True)
class SnapshotHolder:
    """Where one rank's files of an in-memory snapshot of a generation that spanned hosts are held: a
    node and its agent's SnapshotPeer address (host:port)."""

    rank: int
    node: str
    address: str

    def to_json(self) -> list:
        return [self.rank, self.node, self.address]

    @classmethod
    def from_json(cls, data: list) -> "SnapshotHolder":
        return cls(int(data[0]), str(data[1]), str(data[2]))


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a generation starts from (None in GenerationRecord: from scratch)."""

    step: int
    consumed_samples: int
    path: str
    source: ResumeSource = ResumeSource.DISK
    # An in-memory snapshot of a generation that spanned hosts: each of its ranks' holder (every agent
    # of the new generation fetches the files it lacks). Empty for one committed whole in one host's memory.
    holders: tuple[SnapshotHolder, ...] = ()

    def to_json(self) -> dict:
        return {"step": self.step, "consumed_samples": self.consumed_samples, "path": self.path,
                "source": self.source.value, "holders": [h.to_json() for h in self.holders]}

    @classmethod
    def from_json(cls, data: dict) -> "ResumePoint":
        return cls(int(data["step"]), int(data["consumed_samples"]), str(data["path"]),
                   ResumeSource(data.get("source", ResumeSource.DISK.value)),
                   tuple(SnapshotHolder.from_json(h) for h in data.get("holders", ())))


# Generation records (placement and rank table, in etcd) kept besides the current one's: `trainerctl logs
# --generation G` finds through them where a rank of G ran. As many as an agent keeps generations' files
# (agent/generation_dirs.py); a job that restarts for weeks would otherwise fill etcd with rank tables.
KEPT_GENERATION_RECORDS = 32


@dataclass(frozen=True)
class GenerationRecord:
    """A launched generation: decided once, committed to etcd before any Launch is sent."""

    number: int
    placement: Placement
    scheduler_port: int
    rank_table_json: str
    resume: ResumePoint | None = None
    # The SnapshotPeer address (host:port) of each node of the placement whose agent serves one when it
    # was launched: a generation spanning hosts takes in-memory snapshots only when every node has one.
    peer_addresses: dict[str, str] = field(default_factory=dict, hash=False)

    @property
    def start_step(self) -> int:
        return 0 if self.resume is None else self.resume.step

    def to_json(self) -> dict:
        return {"number": self.number, "placement": self.placement.to_json(),
                "scheduler_port": self.scheduler_port, "rank_table": self.rank_table_json,
                "resume": None if self.resume is None else self.resume.to_json(),
                "peer_addresses": dict(self.peer_addresses)}

    @classmethod
    def from_json(cls, data: dict) -> "GenerationRecord":
        resume = data.get("resume")
        return cls(int(data["number"]), Placement.from_json(data["placement"]), int(data["scheduler_port"]),
                   str(data["rank_table"]), None if resume is None else ResumePoint.from_json(resume),
                   {str(k): str(v) for k, v in data.get("peer_addresses", {}).items()})
