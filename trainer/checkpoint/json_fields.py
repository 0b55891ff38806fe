"""Strict readers for fields of JSON documents that come from disk (manifests, rank reports).

Every reader names the document and field in its error, so a hostile or damaged file is refused
with one clear line instead of a KeyError or TypeError deep inside the loader.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from trainer.checkpoint.errors import CorruptCheckpoint
from trainer.checkpoint.file_access import open_regular_file

# Larger than any real manifest (a million chunks), small enough to never exhaust memory.
MAX_JSON_BYTES = 64 << 20
# No real tensor dimension or offset comes near this; it keeps every product far from overflow.
MAX_EXTENT = 1 << 48
MAX_NDIM = 32


def read_json_file(path: Path, what: str) -> dict[str, Any]:
    """The JSON object stored at `path` (a regular file, see `file_access`); refuses files over MAX_JSON_BYTES
    and anything not an object.
    """
    try:
        with os.fdopen(open_regular_file(path.parent, path.name, what), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_JSON_BYTES:
                raise CorruptCheckpoint(
                    f"{what} is {size} bytes, more than the {MAX_JSON_BYTES} a {path.name} may have"
                )
            raw = f.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError as exc:
        raise CorruptCheckpoint(f"{what} is missing") from exc
    except OSError as exc:
        raise CorruptCheckpoint(f"{what} cannot be read: {exc.strerror}") from exc
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpoint(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise CorruptCheckpoint(f"{what} must hold a JSON object")
    return value


def get_field(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise CorruptCheckpoint(f"{where}: field '{key}' is missing")
    return obj[key]


def as_int(value: Any, where: str, minimum: int = 0, maximum: int = MAX_EXTENT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise CorruptCheckpoint(f"{where} must be an integer from {minimum} to {maximum}, got {value!r:.80}")
    return value


def get_int(obj: dict[str, Any], key: str, where: str, minimum: int = 0, maximum: int = MAX_EXTENT) -> int:
    return as_int(get_field(obj, key, where), f"{where}: '{key}'", minimum, maximum)


def get_str(obj: dict[str, Any], key: str, where: str) -> str:
    value = get_field(obj, key, where)
    if not isinstance(value, str):
        raise CorruptCheckpoint(f"{where}: '{key}' must be a string")
    return value


def get_list(obj: dict[str, Any], key: str, where: str) -> list[Any]:
    value = get_field(obj, key, where)
    if not isinstance(value, list):
        raise CorruptCheckpoint(f"{where}: '{key}' must be a list")
    return value


def get_object(obj: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = get_field(obj, key, where)
    if not isinstance(value, dict):
        raise CorruptCheckpoint(f"{where}: '{key}' must be an object")
    return value


def get_extents(obj: dict[str, Any], key: str, where: str) -> tuple[int, ...]:
    """A list of tensor extents (shape, offsets or sizes): at most MAX_NDIM integers in [0, MAX_EXTENT]."""
    values = get_list(obj, key, where)
    if len(values) > MAX_NDIM:
        raise CorruptCheckpoint(f"{where}: '{key}' has {len(values)} dimensions, more than {MAX_NDIM}")
    return tuple(as_int(v, f"{where}: '{key}'") for v in values)


def check_schema(obj: dict[str, Any], where: str) -> None:
    schema = get_field(obj, "schema", where)
    if schema != 1:
        raise CorruptCheckpoint(f"{where}: schema {schema!r:.40} is not supported (this trainerd reads schema 1)")
