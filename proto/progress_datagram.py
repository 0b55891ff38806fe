"""The progress datagrams from a worker to its agent: one versioned JSON message per unix datagram.

Pure (no MindSpore), the one encoder and decoder both ends use: workers encode
(`trainer.runtime.progress`), the agent decodes (`agent.progress_receiver`). One message is one
datagram, so a dropped report costs that report only and can never leave the stream out of step.

Wire format (strict JSON, UTF-8, at most MAX_DATAGRAM_BYTES):

    {"schema": 1, "kind": "step", "job": "mnist", "generation": 3, "rank": 0, "step": 120,
     "loss": 0.31, "grad_norm": 1.7, "samples_per_s": 5400.0, "consumed_samples": 7680,
     "checkpoint_stall_s": 0.42}
    {"schema": 1, "kind": "step", ..., "startup": {"comm_setup_s": 1.9, "load_s": 0.3, "first_step_s": 0.7}}
    {"schema": 1, "kind": "event", "job": "mnist", "generation": 3, "rank": 0, "event": "finished", "step": 500}
    {"schema": 1, "kind": "checkpoint", "job": "mnist", "generation": 3, "rank": 0, "step": 400,
     "consumed_samples": 25600, "path": "/ckpt/mnist/step_00000400"}
    {"schema": 1, "kind": "checkpoint_failed", "job": "mnist", "generation": 3, "rank": 1, "step": 400,
     "reason": "[Errno 28] No space left on device"}
    {"schema": 1, "kind": "bad_batch", "job": "mnist", "generation": 3, "rank": 0, "step": 121,
     "sample_start": 7680, "sample_end": 7744, "reason": "nonfinite_loss", "loss": "NaN", "grad_norm": "NaN"}
    {"schema": 1, "kind": "guard_notice", "job": "mnist", "generation": 3, "rank": 1, "step": 200,
     "notice": "device_suspected", "detail": "grad_norm_spike: loss 0.31 grad norm 9.1e+03, replayed: ..."}
    {"schema": 1, "kind": "warning", "job": "mnist", "generation": 1, "rank": 0, "step": 0,
     "text": "Model.train's callbacks hold a ModelCheckpoint beside TrainerdCallback: ..."}

`loss` and `grad_norm` may be non-finite (that is how a bad batch shows); strict JSON has no NaN,
so they travel as the strings "NaN", "Infinity" and "-Infinity". Readers ignore fields they do not
know, so adding a field does not need a new schema number; changing one does. A field added later is
optional, with a default, so that a reader still takes a writer that predates it
(`checkpoint_stall_s`, default 0; `startup`, absent).

`startup` rides on a rank's first step report of its process only: how long that process's start took,
in three parts timed by the process itself (durations on its own monotonic clock, so hosts' clocks
never need to agree): joining the cluster (`comm_setup_s`: waiting for the scheduler and MindSpore's
`init()`), loading the checkpoint or snapshot it resumes from (`load_s`), and its first step, from
`started` to that step's end (`first_step_s`: the graph compile, or a compile cache load, and one step).
The coordinator splits a recovery's cost with them (daemon/job/timeline.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

SCHEMA = 1
MAX_DATAGRAM_BYTES = 4096
MAX_JOB_NAME = 256
_MAX_INT64 = (1 << 63) - 1
_MAX_INT32 = (1 << 31) - 1
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
MAX_CHECKPOINT_PATH = 1024
MAX_FAILURE_REASON = 1000
MAX_STARTUP_PART_S = 7 * 24 * 3600.0  # a week: a start-up part longer than that is no measurement
# Control characters (and DEL) in a path would let a hostile datagram forge lines in the agent's log.
_CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")


class MalformedProgress(ValueError):
    """A datagram that is not a valid progress message; the message says why in one line."""


class WorkerEvent(StrEnum):
    STARTED = "started"    # communication is up, the first step is about to run
    FINISHED = "finished"  # training completed; the process exits 0 next
    EVALUATING = "evaluating"  # between steps, evaluating (Model.fit's validation): alive, no new step


@dataclass(frozen=True)
class StartupTimes:
    """How long this rank's process took to join the cluster, load its state and run its first step (seconds,
    each finite, from 0 to MAX_STARTUP_PART_S)."""

    comm_setup_s: float
    load_s: float
    first_step_s: float

    @classmethod
    def measured(cls, comm_setup_s: float, load_s: float, first_step_s: float) -> StartupTimes:
        """The times as measured, each held within what a report may carry."""
        def bounded(seconds: float) -> float:
            return min(max(0.0, seconds), MAX_STARTUP_PART_S) if math.isfinite(seconds) else 0.0
        return cls(bounded(comm_setup_s), bounded(load_s), bounded(first_step_s))

    def to_wire(self) -> dict[str, float]:
        return {"comm_setup_s": self.comm_setup_s, "load_s": self.load_s, "first_step_s": self.first_step_s}


@dataclass(frozen=True)
class StepReport:
    """One finished optimizer step as one rank saw it."""

    job: str
    generation: int
    rank: int
    step: int               # optimizer steps completed, counting from 1
    loss: float             # this rank's mean loss over its share of the global batch
    grad_norm: float        # global norm of the all-reduced gradients, before clipping
    samples_per_s: float    # global samples per second over this step
    consumed_samples: int   # global samples consumed by the job after this step
    checkpoint_stall_s: float = 0.0  # seconds this rank's step loop blocked on checkpoint saves, in all
    epoch: int | None = None  # Model.train's epoch (from 1); None for a loop of the script's own
    startup: StartupTimes | None = None  # on the process's first step report only


@dataclass(frozen=True)
class EventReport:
    job: str
    generation: int
    rank: int
    event: WorkerEvent
    step: int


@dataclass(frozen=True)
class CheckpointReport:
    """Rank 0's word that the checkpoint of `step` is committed: its manifest has been renamed into place."""

    job: str
    generation: int
    rank: int
    step: int
    consumed_samples: int  # the stream position training resumes at from this checkpoint
    path: str              # absolute, normalised, ending in step_{step:08d} (MindFormers: iteration_{step:08d})


@dataclass(frozen=True)
class CheckpointFailedReport:
    """A rank's save of `step` failed: that step is not committed and training goes on without it."""

    job: str
    generation: int
    rank: int
    step: int
    reason: str  # one line of printable characters, at most MAX_FAILURE_REASON (see `failure_reason`)


def failure_reason(exc: BaseException) -> str:
    """`exc` as a CheckpointFailedReport's reason (see `one_line`)."""
    return one_line(str(exc) or type(exc).__name__)


def one_line(text: str) -> str:
    """`text` as a report's free text (a failed save's reason, a guard notice's detail, a warning): one line,
    control characters replaced, cut to MAX_FAILURE_REASON characters."""
    text = _CONTROL_CHARACTER.sub(" ", text) or "(no text)"
    return text if len(text) <= MAX_FAILURE_REASON else text[:MAX_FAILURE_REASON - 3] + "..."


class BadBatchReason(StrEnum):
    NONFINITE_LOSS = "nonfinite_loss"
    NONFINITE_GRAD_NORM = "nonfinite_grad_norm"
    GRAD_NORM_SPIKE = "grad_norm_spike"


@dataclass(frozen=True)
class BadBatchReport:
    """A step whose update was skipped, with the global sample range [sample_start, sample_end) it read."""

    job: str
    generation: int
    rank: int
    step: int
    sample_start: int
    sample_end: int
    reason: BadBatchReason
    loss: float       # may be non-finite: that is often the reason
    grad_norm: float  # likewise


class GuardNotice(StrEnum):
    """What a replay of a refused step found, other than bad data (`trainer.runtime.step_replay`)."""

    DEVICE_SUSPECTED = "device_suspected"  # this rank's own gradients differed between the step and its replay
    GUARD_REBASELINED = "guard_rebaselined"  # too many spikes in a window: the guard's statistics were reset


@dataclass(frozen=True)
class GuardNoticeReport:
    job: str
    generation: int
    rank: int
    step: int
    notice: GuardNotice
    detail: str  # one line of printable characters, at most MAX_FAILURE_REASON


@dataclass(frozen=True)
class WarningReport:
    """What the worker runtime found risky about the job (it may work): the coordinator records it as a
    `job_warning` event, once per text, and `trainerctl status` shows it."""

    job: str
    generation: int
    rank: int
    step: int
    text: str  # one line of printable characters, at most MAX_FAILURE_REASON (see `one_line`)


ProgressMessage = (StepReport | EventReport | CheckpointReport | CheckpointFailedReport | BadBatchReport
                   | GuardNoticeReport | WarningReport)


def encode(message: ProgressMessage) -> bytes:
    """The datagram for `message`; raises MalformedProgress for a message no reader would accept."""
    body: dict[str, Any] = {
        "schema": SCHEMA, "job": message.job, "generation": message.generation, "rank": message.rank,
    }
    if isinstance(message, StepReport):
        body |= {
            "kind": "step", "step": message.step, "loss": _float_to_wire(message.loss),
            "grad_norm": _float_to_wire(message.grad_norm), "samples_per_s": _float_to_wire(message.samples_per_s),
            "consumed_samples": message.consumed_samples,
            "checkpoint_stall_s": _float_to_wire(message.checkpoint_stall_s),
        }
        if message.epoch is not None:
            body["epoch"] = message.epoch
        if message.startup is not None:
            body["startup"] = message.startup.to_wire()
    elif isinstance(message, EventReport):
        body |= {"kind": "event", "event": str(message.event), "step": message.step}
    elif isinstance(message, CheckpointReport):
        body |= {"kind": "checkpoint", "step": message.step, "consumed_samples": message.consumed_samples,
                 "path": message.path}
    elif isinstance(message, CheckpointFailedReport):
        body |= {"kind": "checkpoint_failed", "step": message.step, "reason": message.reason}
    elif isinstance(message, GuardNoticeReport):
        body |= {"kind": "guard_notice", "step": message.step, "notice": str(message.notice),
                 "detail": message.detail}
    elif isinstance(message, WarningReport):
        body |= {"kind": "warning", "step": message.step, "text": message.text}
    else:
        body |= {
            "kind": "bad_batch", "step": message.step, "sample_start": message.sample_start,
            "sample_end": message.sample_end, "reason": str(message.reason),
            "loss": _float_to_wire(message.loss), "grad_norm": _float_to_wire(message.grad_norm),
        }
    data = json.dumps(body, allow_nan=False, separators=(",", ":")).encode()
    decode(data)  # the sender refuses what the receiver would: a bad field fails at its source
    return data


def decode(data: bytes) -> ProgressMessage:
    """The message in one datagram; any malformed or hostile input raises MalformedProgress."""
    if len(data) > MAX_DATAGRAM_BYTES:
        raise MalformedProgress(f"datagram of {len(data)} bytes exceeds {MAX_DATAGRAM_BYTES}")
    try:
        body = json.loads(data, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, too many digits, too deep
        raise MalformedProgress(f"not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise MalformedProgress("not a JSON object")
    schema = body.get("schema")
    if type(schema) is not int or schema != SCHEMA:  # true and 1.0 equal 1 in Python, not on the wire
        raise MalformedProgress(f"schema {schema!r:.40} is not {SCHEMA}")
    job = _field(body, "job", str)
    if not 0 < len(job) <= MAX_JOB_NAME:
        raise MalformedProgress(f"job name must have 1 to {MAX_JOB_NAME} characters")
    common = dict(
        job=job,
        generation=_int(body, "generation", _MAX_INT64),
        rank=_int(body, "rank", _MAX_INT32),
        step=_int(body, "step", _MAX_INT64),
    )
    kind = body.get("kind")
    if kind == "step":
        return StepReport(
            **common, loss=_float(body, "loss"), grad_norm=_float(body, "grad_norm"),
            samples_per_s=_float(body, "samples_per_s", finite=True),
            consumed_samples=_int(body, "consumed_samples", _MAX_INT64),
            checkpoint_stall_s=_float(body, "checkpoint_stall_s", finite=True) if "checkpoint_stall_s" in body else 0.0,
            epoch=_int(body, "epoch", _MAX_INT64) if "epoch" in body else None,
            startup=_startup(body) if "startup" in body else None,
        )
    if kind == "event":
        event = _field(body, "event", str)
        try:
            return EventReport(**common, event=WorkerEvent(event))
        except ValueError:
            raise MalformedProgress(f"unknown event {event!r:.40}") from None
    if kind == "checkpoint":
        return CheckpointReport(
            **common, consumed_samples=_int(body, "consumed_samples", _MAX_INT64),
            path=_checkpoint_path(body, common["step"]),
        )
    if kind == "checkpoint_failed":
        return CheckpointFailedReport(**common, reason=_one_line(body, "reason"))
    if kind == "guard_notice":
        notice = _field(body, "notice", str)
        try:
            return GuardNoticeReport(**common, notice=GuardNotice(notice), detail=_one_line(body, "detail"))
        except ValueError:
            raise MalformedProgress(f"unknown guard notice {notice!r:.40}") from None
    if kind == "bad_batch":
        start, end = _int(body, "sample_start", _MAX_INT64), _int(body, "sample_end", _MAX_INT64)
        if end <= start:
            raise MalformedProgress(f"sample range [{start}, {end}) is empty")
        reason = _field(body, "reason", str)
        try:
            reason = BadBatchReason(reason)
        except ValueError:
            raise MalformedProgress(f"unknown bad batch reason {reason!r:.40}") from None
        return BadBatchReport(**common, sample_start=start, sample_end=end, reason=reason,
                              loss=_float(body, "loss"), grad_norm=_float(body, "grad_norm"))
    if kind == "warning":
        return WarningReport(**common, text=_one_line(body, "text"))
    raise MalformedProgress(f"unknown kind {kind!r:.40}")


def _startup(body: dict[str, Any]) -> StartupTimes:
    parts = _field(body, "startup", dict)
    seconds = {}
    for key in ("comm_setup_s", "load_s", "first_step_s"):
        value = _float(parts, key, finite=True)
        if not 0.0 <= value <= MAX_STARTUP_PART_S:
            raise MalformedProgress(f"field 'startup.{key}' must be from 0 to {MAX_STARTUP_PART_S:.0f} s, got {value}")
        seconds[key] = value
    return StartupTimes(**seconds)


def _one_line(body: dict[str, Any], key: str) -> str:
    text = _field(body, key, str)
    if not 0 < len(text) <= MAX_FAILURE_REASON or _CONTROL_CHARACTER.search(text):
        raise MalformedProgress(f"field {key!r} must have 1 to {MAX_FAILURE_REASON} printable characters")
    return text


def _refuse_constant(name: str) -> Any:
    raise MalformedProgress(f"bare {name} is not JSON")


def _float_to_wire(value: float) -> float | str:
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def _field(body: dict[str, Any], key: str, kind: type) -> Any:
    if key not in body:
        raise MalformedProgress(f"field '{key}' is missing")
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise MalformedProgress(f"field '{key}' must be of type {kind.__name__}, got {value!r:.40}")
    return value


def _int(body: dict[str, Any], key: str, maximum: int) -> int:
    value = _field(body, key, int)
    if not 0 <= value <= maximum:
        raise MalformedProgress(f"field '{key}' must be from 0 to {maximum}, got {value}")
    return value


def _checkpoint_path(body: dict[str, Any], step: int) -> str:
    """The step directory of a checkpoint report: the coordinator confines it to the job's checkpoint
    root, so here it need only be a plain absolute path (no '.', '..' or empty parts) of the step."""
    path = _field(body, "path", str)
    if len(path) > MAX_CHECKPOINT_PATH or _CONTROL_CHARACTER.search(path):
        raise MalformedProgress(f"field 'path' must be at most {MAX_CHECKPOINT_PATH} printable characters")
    root, *parts = path.split("/")
    if root or not parts or any(part in ("", ".", "..") for part in parts):
        raise MalformedProgress(f"field 'path' must be an absolute normalised path, got {path!r:.80}")
    # trainer.checkpoint.manifest.step_dir_name, or a MindFormers Checkpoint 2.0 iteration (trainer.integrations)
    if parts[-1] not in (f"step_{step:08d}", f"iteration_{step:08d}"):
        raise MalformedProgress(f"field 'path' must name the directory of step {step}, got {parts[-1]!r:.40}")
    return path


def _float(body: dict[str, Any], key: str, finite: bool = False) -> float:
    if key not in body:
        raise MalformedProgress(f"field '{key}' is missing")
    value = body[key]
    if isinstance(value, str) and value in _NON_FINITE:
        number = _NON_FINITE[value]
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MalformedProgress(f"field '{key}' must be a number, got {value!r:.40}")
    else:
        try:
            number = float(value)
        except OverflowError:
            raise MalformedProgress(f"field '{key}' is out of range") from None
    if finite and not (math.isfinite(number) and number >= 0):  # JSON's 1e400 parses as infinity
        raise MalformedProgress(f"field '{key}' must be a finite number at least 0, got {number}")
    return number
