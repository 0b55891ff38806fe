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


# Trailing metadata a standby coordinator attaches when it refuses a session.
LEADER_ADDRESS_METADATA = "trainerd-leader-address"

NODE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
