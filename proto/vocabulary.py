"""Words both sides of the wire use: node and job states, process roles, metadata keys."""

from __future__ import annotations

import enum


class NodeState(str, enum.Enum):
    READY = "READY"
    LOST = "LOST"


class JobState(str, enum.Enum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    WAITING = "WAITING"
    PAUSED = "PAUSED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"


class ProcessRole(str, enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


# Kernel states (ProcessStatus.os_state) of a process that is not running its code: stopped or traced
# ("T", "t"), or stuck in an uninterruptible sleep ("D"). In a hang, such a rank is the one behind.
FROZEN_OS_STATES = frozenset({"T", "t", "D"})

# Trailing metadata a standby coordinator attaches when it refuses a session.
LEADER_ADDRESS_METADATA = "trainerd-leader-address"

# Match with re.fullmatch: with re.match the `$` also accepts a trailing newline ("n1\n"). The anchors stay
# for pydantic's `pattern=` (agent/config.py), which searches rather than matches the whole string.
NODE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"

# Environment variables of training processes that trainerd sets; a job's `env` may not set them.
# The coordinator sets them all but AGENT_ENV, whose paths only the agent knows.
AGENT_ENV = frozenset({"RANK_TABLE_FILE", "TRAINERD_PROGRESS_SOCKET", "TRAINERD_CONTROL_FILE",
                       "TRAINERD_SKIPS_FILE"})
RESERVED_ENV = AGENT_ENV | frozenset({
    "MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_WORKER_NUM", "MS_NODE_ID", "RANK_ID", "RANK_SIZE",
    "DEVICE_ID", "TRAINERD_JOB", "TRAINERD_GENERATION", "TRAINERD_LOCAL_RANK", "TRAINERD_GLOBAL_BATCH",
    "TRAINERD_MICRO_BATCH", "TRAINERD_GRAD_ACCUM", "TRAINERD_CHECKPOINT_DIR", "TRAINERD_CHECKPOINT_EVERY",
    "TRAINERD_CHECKPOINT_KEEP", "TRAINERD_RESUME_FROM", "TRAINERD_SPIKE_FACTOR", "TRAINERD_SPIKE_WARMUP_STEPS",
    "TRAINERD_SPIKE_ZSCORE", "TRAINERD_SPIKE_CEILING",
})
