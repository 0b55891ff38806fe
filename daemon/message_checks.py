"""Bounds on the fields of what agents send, checked at the servicer before anything uses them.

A peer's message is data, never trusted: every number that reaches arithmetic is finite and in a
range the coordinator's int64 wire fields and its decisions can hold, every string and list has a
bound. A message that breaks one is dropped whole (daemon/grpc_services.py counts and logs it), but for a
heartbeat: there only the field's report goes, and the heartbeat is still acknowledged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence, Sized
from typing import TypeVar

from common.peer_text import escaped
from proto.vocabulary import ProcessRole
from trainer.checkpoint.json_fields import MAX_EXTENT

T = TypeVar("T")

MAX_RANK = 1 << 20  # ranks are 0 to MAX_RANK - 1; -1 is the scheduler
MAX_GENERATION = 1 << 40
# Steps and epochs: no further than a checkpoint's manifest can record (its integers stop at 2**48), so a
# step a node claims is one the job could resume from, and the sums the decisions make stay far from overflow.
MAX_STEP = MAX_EXTENT
MAX_FILE_OFFSET = 1 << 62  # offsets and sizes in a log file
MAX_SAMPLE_POSITION = 10**15  # consumed samples and skipped ranges (the skip ledger's bound)
MAX_SAMPLES_PER_S = 1e12
# A year: a rank's checkpoint stall in one generation is far less.
MAX_STALL_S = 365 * 86400.0
MAX_PROCESSES_PER_HEARTBEAT = 256
MAX_DEVICE_ID = 1 << 16
MAX_HELLO_TEXT_CHARS = 255
MAX_PATH_CHARS = 4096
MAX_REASON_CHARS = 100
MAX_FAILURE_REASON_CHARS = 1000  # proto.progress_datagram.MAX_FAILURE_REASON: why a checkpoint save failed
MAX_WARNING_CHARS = 1000  # proto.progress_datagram.MAX_FAILURE_REASON: what a worker found risky about its job
MAX_CAUSE_CHARS = 500
MAX_LOCATION_CHARS = 300
MAX_LOG_TAIL_CHARS = 4000


class MalformedMessage(ValueError):
    """A field of an agent's message is out of its bounds; the message says which, in one line."""


def bounded_int(value: int, low: int, high: int, what: str) -> int:
    if not low <= value <= high:
        raise MalformedMessage(f"{what} {value} is not in {low}..{high}")
    return value


def generation(value: int) -> int:
    return bounded_int(value, 0, MAX_GENERATION, "generation")


def step(value: int, what: str = "step") -> int:
    return bounded_int(value, 0, MAX_STEP, what)


def sample_position(value: int, what: str) -> int:
    return bounded_int(value, 0, MAX_SAMPLE_POSITION, what)


def rank(value: int) -> int:
    return bounded_int(value, 0, MAX_RANK - 1, "rank")


def process_rank(role_text: str, value: int) -> tuple[ProcessRole, int]:
    """The role and rank of a process: the scheduler is rank -1, a worker 0 to MAX_RANK - 1."""
    try:
        role = ProcessRole(role_text)
    except ValueError:
        raise MalformedMessage(f"role {role_text[:40]!r} is not one of "
                               f"{', '.join(r.value for r in ProcessRole)}") from None
    if role is ProcessRole.SCHEDULER:
        return role, bounded_int(value, -1, -1, "scheduler rank")
    return role, rank(value)


def finite(value: float, what: str, low: float = -math.inf, high: float = math.inf) -> float:
    if not (math.isfinite(value) and low <= value <= high):
        raise MalformedMessage(f"{what} {value!r} is not a finite number in {low:g}..{high:g}")
    return value


def text(value: str, limit: int, what: str) -> str:
    if len(value) > limit:
        raise MalformedMessage(f"{what} has {len(value)} characters, more than {limit}")
    return value


def count(items: Sized, limit: int, what: str) -> None:
    if len(items) > limit:
        raise MalformedMessage(f"{len(items)} {what}, more than {limit}")


def bounded_list(items: Sequence[T], limit: int, what: str) -> Sequence[T]:
    """`items`, when there are at most `limit` of them."""
    count(items, limit, what)
    return items


def printable(value: str, limit: int, what: str) -> str:
    """A peer's text that means something as it is (a host, a path): at most `limit` characters, none of them
    a control character (escaping would change what it names)."""
    text(value, limit, what)
    if not value.isprintable():
        raise MalformedMessage(f"{what} {escaped(value[:80])!r} holds a character that is not printable")
    return value


def one_line(value: str, limit: int) -> str:
    """A peer's text as one printable line of at most `limit` characters, its control characters escaped
    (common/peer_text.py): it goes into logs, events and status."""
    return escaped(value[:limit].strip())
