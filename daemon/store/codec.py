"""Stored values are versioned JSON objects (`"schema": 1`), never pickle.

The schema number lets a newer trainerd refuse, with a clear error, a value written in a layout
it does not know, instead of misreading it.
"""

from __future__ import annotations

import json

from daemon.errors import PermanentError
from daemon.store.interface import StoreError

SCHEMA = 1


class BadValue(StoreError, PermanentError):
    """A stored value is not a JSON object of a known schema: reading it again gives the same bytes,
    so the caller should stop and report the key (a newer trainerd, or a hand-edited etcd)."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"bad value at {key}: {reason}")
        self.key = key
        self.reason = reason


def encode(obj: dict) -> bytes:
    """`obj` as compact UTF-8 JSON with `"schema": 1` added."""
    if "schema" in obj and obj["schema"] != SCHEMA:
        raise ValueError(f"refusing to encode an object that carries schema {obj['schema']!r}")
    return json.dumps({**obj, "schema": SCHEMA}, sort_keys=True, separators=(",", ":"),
                      allow_nan=False).encode()


def decode(data: bytes, *, key: str) -> dict:
    """The object `encode` was given; raises BadValue naming `key` when `data` is not one."""
    try:
        obj = json.loads(data)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        raise BadValue(key, f"not JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise BadValue(key, f"expected a JSON object, got {type(obj).__name__}")
    schema = obj.pop("schema", None)
    if schema != SCHEMA:
        raise BadValue(key, f"unknown schema {schema!r} (this trainerd reads schema {SCHEMA})")
    return obj
