from __future__ import annotations

import json

import pytest

from daemon.store import codec
from daemon.store.interface import StoreError


def test_a_value_round_trips_and_is_stored_as_json_with_schema_1() -> None:
    obj = {"state": "RUNNING", "generation": 3, "nodes": ["n1", "n2"]}
    data = codec.encode(obj)
    assert json.loads(data) == {**obj, "schema": 1}
    assert codec.decode(data, key="/trainerd/v1/jobs/j/status") == obj


@pytest.mark.parametrize("data, reason", [
    (b"\x80\x04\x95 not json", "not JSON"),  # e.g. a pickle
    (b"[1, 2]", "expected a JSON object, got list"),
    (b'{"state": "RUNNING"}', "unknown schema None"),
    (b'{"state": "RUNNING", "schema": 2}', "unknown schema 2"),
])
def test_a_bad_value_is_refused_with_the_key_named(data: bytes, reason: str) -> None:
    with pytest.raises(StoreError) as error:  # what a store caller already handles
        codec.decode(data, key="/trainerd/v1/jobs/j/status")
    assert error.value.key == "/trainerd/v1/jobs/j/status"
    message = str(error.value)
    assert message.startswith("bad value at /trainerd/v1/jobs/j/status: ")
    assert reason in message
    assert "\n" not in message


def test_encode_refuses_an_object_claiming_another_schema() -> None:
    with pytest.raises(ValueError, match="schema 2"):
        codec.encode({"schema": 2})
