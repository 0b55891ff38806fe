"""The progress wire format: round trips, and hostile datagrams refused with a clear error, never a crash."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto.progress_datagram import (
    MAX_CHECKPOINT_PATH,
    MAX_DATAGRAM_BYTES,
    MAX_FAILURE_REASON,
    MAX_STARTUP_PART_S,
    BadBatchReason,
    BadBatchReport,
    CheckpointFailedReport,
    CheckpointReport,
    EventReport,
    MalformedProgress,
    StartupTimes,
    StepReport,
    WarningReport,
    WorkerEvent,
    decode,
    encode,
    failure_reason,
    one_line,
)

STEP = StepReport(job="llm", generation=3, rank=1, step=120, loss=0.31, grad_norm=1.7,
                  samples_per_s=5400.0, consumed_samples=7680, checkpoint_stall_s=0.42, epoch=4)
EVENT = EventReport(job="llm", generation=3, rank=1, event=WorkerEvent.FINISHED, step=500)
CHECKPOINT = CheckpointReport(job="llm", generation=3, rank=0, step=400, consumed_samples=25600,
                              path="/ckpt/llm/step_00000400")
CHECKPOINT_FAILED = CheckpointFailedReport(job="llm", generation=3, rank=1, step=400,
                                           reason="[Errno 28] No space left on device")
BAD_BATCH = BadBatchReport(job="llm", generation=3, rank=0, step=121, sample_start=7680, sample_end=7744,
                           reason=BadBatchReason.GRAD_NORM_SPIKE, loss=2.5, grad_norm=91.0)
WARNING = WarningReport(job="llm", generation=1, rank=0, step=0, text="a ModelCheckpoint beside TrainerdCallback")


def valid_body() -> dict[str, Any]:
    return json.loads(encode(STEP))


def test_messages_round_trip() -> None:
    evaluating = EventReport(job="llm", generation=3, rank=1, event=WorkerEvent.EVALUATING, step=200)
    for message in (STEP, EVENT, evaluating, CHECKPOINT, CHECKPOINT_FAILED, BAD_BATCH, WARNING):
        assert decode(encode(message)) == message


def test_wire_is_strict_versioned_json() -> None:
    assert json.loads(encode(EVENT)) == {
        "schema": 1, "kind": "event", "job": "llm", "generation": 3, "rank": 1, "event": "finished", "step": 500,
    }


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_loss_survives_as_strict_json(value: float) -> None:
    """A bad batch shows as a NaN or infinite loss: the agent must see it, and strict JSON has no NaN."""
    data = encode(StepReport(**{**STEP.__dict__, "loss": value, "grad_norm": value}))
    json.loads(data, parse_constant=lambda name: pytest.fail(f"bare {name} on the wire"))
    message = decode(data)
    assert isinstance(message, StepReport)
    assert math.isnan(message.loss) if math.isnan(value) else message.loss == value


def test_unknown_fields_are_ignored() -> None:
    """Adding a field is compatible within schema 1."""
    assert decode(json.dumps(valid_body() | {"added_later": [1, 2]}).encode()) == STEP


@pytest.mark.parametrize(("data", "reason"), [
    (b"", "not JSON"),
    (b"\xff\xfe\x00", "not JSON"),
    # Deep nesting is refused either way: as too deep for the parser, or (when another test raised
    # the recursion limit) as not an object.
    (b"[" * 2000 + b"]" * 2000, "not JSON|not a JSON object"),
    (b'{"schema": 1, "loss": NaN}', "not JSON"),
    (b"[]", "not a JSON object"),
    (b"null", "not a JSON object"),
    (b"{}", "schema None is not 1"),
    (b" " * (MAX_DATAGRAM_BYTES + 1), "exceeds"),
])
def test_garbage_is_refused(data: bytes, reason: str) -> None:
    with pytest.raises(MalformedProgress, match=reason):
        decode(data)


@pytest.mark.parametrize(("change", "reason"), [
    ({"schema": 2}, "schema 2 is not 1"),
    ({"schema": "1"}, "schema '1' is not 1"),
    ({"schema": True}, "schema True is not 1"),
    ({"kind": "checkpointed"}, "unknown kind 'checkpointed'"),
    ({"job": ""}, "job name must have"),
    ({"job": "x" * 300}, "job name must have"),
    ({"job": 7}, "'job' must be of type str"),
    ({"step": True}, "'step' must be of type int"),
    ({"step": -1}, "'step' must be from 0"),
    ({"step": 1 << 70}, "'step' must be from 0"),
    ({"rank": 1 << 31}, "'rank' must be from 0"),
    ({"generation": 1.0}, "'generation' must be of type int"),
    ({"loss": "0.3"}, "'loss' must be a number"),
    ({"loss": None}, "'loss' must be a number"),
    ({"samples_per_s": "Infinity"}, "'samples_per_s' must be a finite number"),
    ({"samples_per_s": -1.0}, "'samples_per_s' must be a finite number"),
    ({"consumed_samples": [1]}, "'consumed_samples' must be of type int"),
    ({"checkpoint_stall_s": -0.5}, "'checkpoint_stall_s' must be a finite number"),
    ({"checkpoint_stall_s": "NaN"}, "'checkpoint_stall_s' must be a finite number"),
    ({"epoch": -1}, "'epoch' must be from 0"),
    ({"epoch": 2.0}, "'epoch' must be of type int"),
    ({"epoch": None}, "'epoch' must be of type int"),
])
def test_bad_fields_are_refused_by_name(change: dict[str, Any], reason: str) -> None:
    with pytest.raises(MalformedProgress, match=reason):
        decode(json.dumps(valid_body() | change).encode())


@pytest.mark.parametrize("field", ["job", "generation", "rank", "step", "loss", "grad_norm",
                                   "samples_per_s", "consumed_samples"])
def test_a_missing_field_is_named(field: str) -> None:
    body = valid_body()
    del body[field]
    with pytest.raises(MalformedProgress, match=f"'{field}' is missing"):
        decode(json.dumps(body).encode())


def test_a_step_report_of_a_loop_without_epochs_has_none() -> None:
    loop = StepReport(**{**STEP.__dict__, "epoch": None})
    assert "epoch" not in json.loads(encode(loop)) and decode(encode(loop)).epoch is None


def test_a_step_report_from_a_writer_without_the_checkpoint_stall_reads_as_none_stalled() -> None:
    """checkpoint_stall_s came later: a worker of an older trainerd still reports its steps."""
    body = valid_body()
    del body["checkpoint_stall_s"]
    message = decode(json.dumps(body).encode())
    assert isinstance(message, StepReport) and message.checkpoint_stall_s == 0.0 and message.step == STEP.step


def test_a_first_step_report_carries_the_start_up_times_and_hostile_ones_are_refused_by_name() -> None:
    first = StepReport(**{**STEP.__dict__, "startup": StartupTimes(1.9, 0.3, 0.7)})
    assert json.loads(encode(first))["startup"] == {"comm_setup_s": 1.9, "load_s": 0.3, "first_step_s": 0.7}
    assert decode(encode(first)) == first and "startup" not in json.loads(encode(STEP))
    for bad, reason in [([1.0], "'startup' must be of type dict"),
                        ({"comm_setup_s": 1.0, "load_s": 0.0}, "'first_step_s' is missing"),
                        ({"comm_setup_s": "NaN", "load_s": 0.0, "first_step_s": 0.0}, "'comm_setup_s' must be a finite"),
                        ({"comm_setup_s": -1.0, "load_s": 0.0, "first_step_s": 0.0}, "'comm_setup_s' must be a finite"),
                        ({"comm_setup_s": 0.0, "load_s": 1e12, "first_step_s": 0.0}, "'startup.load_s' must be from 0"),
                        ({"comm_setup_s": 0.0, "load_s": True, "first_step_s": 0.0}, "'load_s' must be a number")]:
        with pytest.raises(MalformedProgress, match=reason):
            decode(json.dumps(valid_body() | {"startup": bad}).encode())


def test_measured_start_up_times_are_held_within_what_a_report_carries() -> None:
    assert StartupTimes.measured(-0.5, math.inf, 1e12) == StartupTimes(0.0, 0.0, MAX_STARTUP_PART_S)
    assert StartupTimes.measured(math.nan, 0.25, 3.0) == StartupTimes(0.0, 0.25, 3.0)


def test_number_overflow_is_refused() -> None:
    """JSON's 1e400 reads as infinity, a 300-digit integer does not fit a float."""
    with pytest.raises(MalformedProgress, match="'samples_per_s' must be a finite number"):
        decode(json.dumps(valid_body() | {"samples_per_s": "?"}).replace('"?"', "1e400").encode())
    with pytest.raises(MalformedProgress, match="'loss' is out of range"):
        decode(json.dumps(valid_body() | {"loss": 10 ** 400}).encode())


def test_unknown_event_is_refused() -> None:
    body = json.loads(encode(EVENT)) | {"event": "exploded"}
    with pytest.raises(MalformedProgress, match="unknown event 'exploded'"):
        decode(json.dumps(body).encode())


def test_the_sender_refuses_what_no_receiver_would_accept() -> None:
    with pytest.raises(MalformedProgress, match="'samples_per_s'"):
        encode(StepReport(**{**STEP.__dict__, "samples_per_s": math.nan}))
    with pytest.raises(MalformedProgress, match="'path'"):
        encode(CheckpointReport(**{**CHECKPOINT.__dict__, "path": "ckpt/step_00000400"}))


def test_new_kinds_are_strict_versioned_json() -> None:
    assert json.loads(encode(CHECKPOINT)) == {
        "schema": 1, "kind": "checkpoint", "job": "llm", "generation": 3, "rank": 0, "step": 400,
        "consumed_samples": 25600, "path": "/ckpt/llm/step_00000400",
    }
    assert json.loads(encode(CHECKPOINT_FAILED)) == {
        "schema": 1, "kind": "checkpoint_failed", "job": "llm", "generation": 3, "rank": 1, "step": 400,
        "reason": "[Errno 28] No space left on device",
    }
    nan_batch = BadBatchReport(**{**BAD_BATCH.__dict__, "reason": BadBatchReason.NONFINITE_LOSS,
                                  "loss": math.nan, "grad_norm": math.inf})
    assert json.loads(encode(nan_batch)) == {
        "schema": 1, "kind": "bad_batch", "job": "llm", "generation": 3, "rank": 0, "step": 121,
        "sample_start": 7680, "sample_end": 7744, "reason": "nonfinite_loss", "loss": "NaN", "grad_norm": "Infinity",
    }
    decoded = decode(encode(nan_batch))
    assert isinstance(decoded, BadBatchReport) and math.isnan(decoded.loss) and decoded.grad_norm == math.inf


@pytest.mark.parametrize(("change", "reason"), [
    ({"path": "ckpt/llm/step_00000400"}, "'path' must be an absolute normalised path"),
    ({"path": "/ckpt/../etc/step_00000400"}, "'path' must be an absolute normalised path"),
    ({"path": "/ckpt/./step_00000400"}, "'path' must be an absolute normalised path"),
    ({"path": "/ckpt//step_00000400"}, "'path' must be an absolute normalised path"),
    ({"path": "/ckpt/step_00000400/"}, "'path' must be an absolute normalised path"),
    ({"path": "/"}, "'path' must be an absolute normalised path"),
    ({"path": ""}, "'path' must be an absolute normalised path"),
    ({"path": "/ckpt/step_00000399"}, "'path' must name the directory of step 400, got 'step_00000399'"),
    ({"path": "/ckpt/step_400"}, "'path' must name the directory of step 400"),
    ({"path": "/ckpt/llm/step_00000400/rank_0.safetensors"}, "'path' must name the directory of step 400"),
    ({"path": "/ckpt\n2026 INFO forged/step_00000400"}, "'path' must be at most .* printable characters"),
    ({"path": "/ckpt\x00/step_00000400"}, "'path' must be at most .* printable characters"),
    ({"path": "/" + "a" * MAX_CHECKPOINT_PATH + "/step_00000400"}, "'path' must be at most"),
    ({"path": ["/ckpt/step_00000400"]}, "'path' must be of type str"),
    ({"consumed_samples": -64}, "'consumed_samples' must be from 0"),
    ({"consumed_samples": 1.5}, "'consumed_samples' must be of type int"),
])
def test_bad_checkpoint_reports_are_refused_by_name(change: dict[str, Any], reason: str) -> None:
    with pytest.raises(MalformedProgress, match=reason):
        decode(json.dumps(json.loads(encode(CHECKPOINT)) | change).encode())


@pytest.mark.parametrize(("change", "reason"), [
    ({"reason": "too_loud"}, "unknown bad batch reason 'too_loud'"),
    ({"reason": 1}, "'reason' must be of type str"),
    ({"sample_end": 7680}, r"sample range \[7680, 7680\) is empty"),
    ({"sample_start": 8000}, r"sample range \[8000, 7744\) is empty"),
    ({"sample_start": -1}, "'sample_start' must be from 0"),
    ({"sample_end": True}, "'sample_end' must be of type int"),
    ({"loss": "nan"}, "'loss' must be a number"),
    ({"grad_norm": None}, "'grad_norm' must be a number"),
])
def test_bad_batch_reports_are_refused_by_name(change: dict[str, Any], reason: str) -> None:
    with pytest.raises(MalformedProgress, match=reason):
        decode(json.dumps(json.loads(encode(BAD_BATCH)) | change).encode())


@pytest.mark.parametrize(("change", "reason"), [
    ({"reason": ""}, "'reason' must have 1 to"),
    ({"reason": "r" * (MAX_FAILURE_REASON + 1)}, "'reason' must have 1 to"),
    ({"reason": "full\n2026 INFO forged"}, "'reason' must have 1 to .* printable characters"),
    ({"reason": 28}, "'reason' must be of type str"),
])
def test_bad_checkpoint_failures_are_refused_by_name(change: dict[str, Any], reason: str) -> None:
    with pytest.raises(MalformedProgress, match=reason):
        decode(json.dumps(json.loads(encode(CHECKPOINT_FAILED)) | change).encode())


def test_a_failure_reason_is_one_line_no_longer_than_a_report_takes() -> None:
    assert failure_reason(OSError(28, "No space left on device")) == "[Errno 28] No space left on device"
    assert failure_reason(ValueError("two\nlines")) == "two lines"
    assert failure_reason(KeyError()) == "KeyError"
    long = failure_reason(OSError("x" * 5000))
    assert len(long) == MAX_FAILURE_REASON and long.endswith("...")
    encode(CheckpointFailedReport(**{**CHECKPOINT_FAILED.__dict__, "reason": long}))


@pytest.mark.parametrize(("message", "field"), [
    *((CHECKPOINT, f) for f in ("step", "consumed_samples", "path")),
    *((CHECKPOINT_FAILED, f) for f in ("step", "reason")),
    *((BAD_BATCH, f) for f in ("step", "sample_start", "sample_end", "reason", "loss", "grad_norm")),
])
def test_a_missing_field_of_a_new_kind_is_named(message: CheckpointReport | CheckpointFailedReport | BadBatchReport,
                                                field: str) -> None:
    body = json.loads(encode(message))
    del body[field]
    with pytest.raises(MalformedProgress, match=f"'{field}' is missing"):
        decode(json.dumps(body).encode())


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_arbitrary_bytes_never_crash_the_decoder(data: bytes) -> None:
    try:
        decode(data)
    except MalformedProgress:
        pass


@settings(max_examples=600, deadline=None)
@given(st.sampled_from([STEP, CHECKPOINT, CHECKPOINT_FAILED, BAD_BATCH]).flatmap(
    lambda message: st.tuples(st.just(message), st.sampled_from(sorted(json.loads(encode(message)))))), json_values)
def test_any_value_in_any_field_is_decoded_or_refused(message_and_field: tuple[Any, str], value: Any) -> None:
    message, field = message_and_field
    data = json.dumps(json.loads(encode(message)) | {field: value}).encode()
    try:
        decoded = decode(data)
    except MalformedProgress:
        return
    assert type(decoded) is type(message) or field == "kind"


def test_a_mindformers_iteration_directory_is_a_checkpoint_path() -> None:
    """MindFormers Checkpoint 2.0 commits iteration_NNNNNNNN directories (trainer.integrations.mindformers)."""
    report = CheckpointReport(**{**CHECKPOINT.__dict__, "path": "/ckpt/llm/iteration_00000400"})
    assert decode(encode(report)) == report
    with pytest.raises(MalformedProgress, match="must name the directory of step 400"):
        encode(CheckpointReport(**{**CHECKPOINT.__dict__, "path": "/ckpt/llm/iteration_00000399"}))


@pytest.mark.parametrize(("change", "reason"), [
    ({"text": ""}, "'text' must have 1 to"),
    ({"text": "t" * (MAX_FAILURE_REASON + 1)}, "'text' must have 1 to"),
    ({"text": "risky\n2026 INFO forged"}, "'text' must have 1 to .* printable characters"),
    ({"text": 1}, "'text' must be of type str"),
])
def test_bad_warnings_are_refused_by_name(change: dict[str, Any], reason: str) -> None:
    with pytest.raises(MalformedProgress, match=reason):
        decode(json.dumps(json.loads(encode(WARNING)) | change).encode())


def test_a_one_line_is_one_line_no_longer_than_a_report_takes() -> None:
    assert one_line("two\nlines") == "two lines"
    long = one_line("x" * 5000)
    assert len(long) == MAX_FAILURE_REASON and long.endswith("...")
    encode(WarningReport(**{**WARNING.__dict__, "text": long}))
