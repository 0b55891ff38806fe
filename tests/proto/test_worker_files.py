"""The control and skips files the agent writes for its workers: the bytes on disk, round trips, and
malformed files refused with a one-line reason, never a crash."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto.worker_files import (
    MAX_CONTROL_BYTES,
    ControlFileRequest,
    MalformedControlFile,
    MalformedSkipsFile,
    SkipList,
    decode_control,
    decode_skips,
    encode_control,
    encode_skips,
)


def test_the_control_file_on_disk() -> None:
    """Workers of an older trainerd read these bytes: they do not change without a new schema."""
    assert encode_control(ControlFileRequest(generation=4, step=1200)) == (
        b'{"schema": 1, "generation": 4, "checkpoint_at_step": 1200}')


def test_the_skips_file_on_disk() -> None:
    assert encode_skips(SkipList(((7680, 7744), (12800, 12864)))) == (
        b'{"schema": 1, "ranges": [[7680, 7744], [12800, 12864]]}')
    assert encode_skips(SkipList()) == b'{"schema": 1, "ranges": []}'


def test_files_round_trip() -> None:
    request = ControlFileRequest(generation=3, step=(1 << 63) - 1)
    assert decode_control(encode_control(request)) == request
    skips = SkipList(((128, 192), (0, 64)))  # as the coordinator sent them: not sorted, not merged
    assert decode_skips(encode_skips(skips)) == skips


def control(body: object) -> bytes:
    return (body if isinstance(body, str) else json.dumps(body)).encode()


@pytest.mark.parametrize(("body", "problem"), [
    ("", "not JSON"),
    ("{\"schema\": 1, \"generation\": 4, \"checkpoint_at_step\": NaN}", "not JSON: bare NaN"),
    ("[" * 2000 + "]" * 2000, "not JSON|not a JSON object"),
    ("[]", "not a JSON object"),
    (" " * (MAX_CONTROL_BYTES + 1), f"more than {MAX_CONTROL_BYTES}"),
    ({"schema": 2, "generation": 4, "checkpoint_at_step": 5}, "schema 2 is not 1"),
    ({"schema": True, "generation": 4, "checkpoint_at_step": 5}, "schema True is not 1"),
    ({"schema": 1.0, "generation": 4, "checkpoint_at_step": 5}, "schema 1.0 is not 1"),
    ({"schema": 1, "checkpoint_at_step": 5}, "'generation' must be an integer"),
    ({"schema": 1, "generation": "4", "checkpoint_at_step": 5}, "'generation' must be an integer"),
    ({"schema": 1, "generation": 4, "checkpoint_at_step": True}, "'checkpoint_at_step' must be an integer"),
    ({"schema": 1, "generation": 4, "checkpoint_at_step": -5}, "'checkpoint_at_step' must be an integer"),
    ({"schema": 1, "generation": 4, "checkpoint_at_step": 1 << 64}, "'checkpoint_at_step' must be an integer"),
    ({"schema": 1, "generation": 4, "checkpoint_at_step": 5.0}, "'checkpoint_at_step' must be an integer"),
])
def test_malformed_control_files_are_refused(body: object, problem: str) -> None:
    with pytest.raises(MalformedControlFile, match=problem) as caught:
        decode_control(control(body))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("body", "problem"), [
    ("{", "the skip ledger is not JSON"),
    ("\xff", "the skip ledger is not JSON"),
    ('{"schema": 1, "ranges": [[0, NaN]]}', "the skip ledger is not JSON: bare NaN"),
    ("[" * 2000 + "]" * 2000, "is not JSON|must be"),
    ("[]", r'must be \{"schema": 1, "ranges"'),
    ({"schema": 1}, "must be"),
    ({"schema": 1, "ranges": [], "extra": 0}, "must be"),
    ({"schema": 2, "ranges": []}, "skip ledger schema 2 is not 1"),
    ({"schema": True, "ranges": []}, "skip ledger schema True is not 1"),
    ({"schema": 1, "ranges": {}}, "ranges must be a list"),
    ({"schema": 1, "ranges": [[5, 1]]}, r"skip range #0 \[5, 1\] is empty"),
    ({"schema": 1, "ranges": [[0, 4], [-1, 3]]}, r"skip range #1 \[-1, 3\] starts before position 0"),
    ({"schema": 1, "ranges": [[1, 1 << 63]]}, r"skip range #0 .* ends after position"),
    ({"schema": 1, "ranges": [[1.0, 4]]}, r"skip range #0 \[1.0, 4\] is not a pair of integers"),
    ({"schema": 1, "ranges": [[True, 4]]}, r"skip range #0 \[True, 4\] is not a pair of integers"),
    ({"schema": 1, "ranges": [[1, 2, 3]]}, r"skip range #0 \[1, 2, 3\] is not a pair"),
    ({"schema": 1, "ranges": [5]}, r"skip range #0 5 is not a pair"),
])
def test_malformed_skips_files_are_refused(body: object, problem: str) -> None:
    with pytest.raises(MalformedSkipsFile, match=problem) as caught:
        decode_skips(body.encode("latin-1") if isinstance(body, str) else json.dumps(body).encode())
    assert "\n" not in str(caught.value)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash_the_decoders(data: bytes) -> None:
    for decode, malformed in ((decode_control, MalformedControlFile), (decode_skips, MalformedSkipsFile)):
        try:
            decode(data)
        except malformed:
            pass
