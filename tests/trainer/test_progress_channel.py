"""The progress wire format: round trips, and hostile datagrams refused with a clear error, never a crash."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.progress_channel import (
    MAX_DATAGRAM_BYTES, EventReport, MalformedProgress, StepReport, WorkerEvent, decode, encode,
)

STEP = StepReport(job="llm", generation=3, rank=1, step=120, loss=0.31, grad_norm=1.7,
                  samples_per_s=5400.0, consumed_samples=7680)
EVENT = EventReport(job="llm", generation=3, rank=1, event=WorkerEvent.FINISHED, step=500)


def valid_body() -> dict[str, Any]:
    return json.loads(encode(STEP))


def test_messages_round_trip() -> None:
    assert decode(encode(STEP)) == STEP
    assert decode(encode(EVENT)) == EVENT


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
    ({"kind": "checkpoint"}, "unknown kind 'checkpoint'"),
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


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(valid_body())), json_values)
def test_any_value_in_any_field_is_decoded_or_refused(field: str, value: Any) -> None:
    data = json.dumps(valid_body() | {field: value}).encode()
    try:
        message = decode(data)
    except MalformedProgress:
        return
    assert isinstance(message, StepReport)
