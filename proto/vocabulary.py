"""Words both sides of the wire use: node and job states, process roles, metadata keys (the environment
variables trainerd sets and those a job may not are `proto.launch_env`'s)."""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from pathlib import PurePath


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


class CauseKind(enum.StrEnum):
    """What a failed process's root cause is (the agent reads it from the output; the coordinator
    compares errors by it, daemon/job/state.py error_key)."""

    PYTHON_EXCEPTION = "python_exception"
    FATAL_ERROR = "fatal_error"  # a crash in native code, as the interpreter's fault handler reported it
    MINDSPORE_ERROR = "mindspore_error"
    LAST_LINE = "last_line"
    # Not the process's own failure: its agent stopped it, having heard no coordinator for the heartbeat
    # timeout (agent/fence.py): the world it trained in had moved on without its node
    FENCED = "fenced"
    # Not started at all: the agent refused the Launch (an entrypoint or a variable it does not allow, an unsafe
    # path, an environment the system cannot pass); the coordinator records it as a `launch_refused` event
    LAUNCH_REFUSED = "launch_refused"


# Kernel states (ProcessStatus.os_state) of a process that is not running its code: stopped or traced
# ("T", "t"), or stuck in an uninterruptible sleep ("D"). In a hang, such a rank is the one behind.
FROZEN_OS_STATES = frozenset({"T", "t", "D"})

# Trailing metadata a standby coordinator attaches when it refuses a session.
LEADER_ADDRESS_METADATA = "trainerd-leader-address"
# Trailing metadata of a Hello deferred at admission (RESOURCE_EXHAUSTED): milliseconds to wait before
# trying again; the agent adds jitter so the deferred ones do not come back together, coming back at
# most RETRY_AFTER_SPREAD times the hint later (the coordinator holds a deferred node that long).
RETRY_AFTER_MS_METADATA = "trainerd-retry-after-ms"
RETRY_AFTER_SPREAD = 1.5
MAX_RETRY_AFTER_S = 60.0  # the longest hint an agent honours
# How long an agent waits for a Welcome (agent/session.py), and the longest wait a Hello may name
# (Hello.next_welcome_wait_s; a longer one is malformed).
MAX_WELCOME_WAIT_S = 60.0

# Match with re.fullmatch: with re.match the `$` also accepts a trailing newline ("n1\n"). The anchors stay
# for pydantic's `pattern=` (agent/config.py), which searches rather than matches the whole string.
NODE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"

# The first word of an argv that stands for the agent's own interpreter (the agent expands it at launch):
# a bare `python` would be whichever one PATH finds on each host. An agent runs only this by default
# (its `allowed_entrypoints`), and local agents run nothing else.
PYTHON_WORD = "{python}"
DEFAULT_ALLOWED_ENTRYPOINTS: tuple[tuple[str, ...], ...] = ((PYTHON_WORD,),)
# The scheduler of a job the agent's own interpreter runs: MindSpore's scheduler and none of the job's code
# (trainer/runtime/scheduler.py says why). An agent runs it whatever its allowed_entrypoints: it is trainerd's
# own code with no arguments, in the interpreter the agent itself runs.
SCHEDULER_ARGV: tuple[str, ...] = (PYTHON_WORD, "-m", "trainer.runtime.scheduler")


def names_a_python(word: str) -> bool:
    """Whether an argv's first word names a Python interpreter (`python`, `python3.11`, `/usr/bin/python3`)."""
    return re.fullmatch(r"python[\d.]*", PurePath(word).name) is not None


def starts_with_one_of(argv: Sequence[str], prefixes: Iterable[Sequence[str]]) -> bool:
    """Whether `argv` begins with one of `prefixes`, word by word (as an agent's allowed_entrypoints are read)."""
    return any(list(argv[:len(prefix)]) == list(prefix) for prefix in prefixes)


def with_python(argv: list[str]) -> list[str]:
    """`argv` with a first word that names a python as PYTHON_WORD: the form to suggest to whoever wrote it."""
    return [PYTHON_WORD, *argv[1:]] if argv and names_a_python(argv[0]) else argv
