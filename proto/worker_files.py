"""The files an agent hands the workers of a generation, each with its one encoder and one decoder.

The agent writes them in the generation's directory and names them in the workers' environment:

- the control file (TRAINERD_CONTROL_FILE), written when the coordinator asks for a checkpoint and read
  by every rank after every step (`trainer.runtime.checkpoint_schedule`):

      {"schema": 1, "generation": 4, "checkpoint_at_step": 1200}

- the skips file (TRAINERD_SKIPS_FILE), written at launch: the skip ledger the generation honours,
  half-open [start, end) sample positions, read once at start-up (`trainer.data.skip_ranges`):

      {"schema": 1, "ranges": [[7680, 7744], [12800, 12864]]}

Both are replaced with `common.atomic_write.write_atomically`, so a worker sees the old file or the whole new one. The
encoders write what they are given: the decoders are the gate, and a worker refuses a malformed file
(the control file with a warning, the skips file by exiting 2). Pure Python: no MindSpore, pydantic
or YAML.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SCHEMA = 1
# A control file is a few dozen bytes; anything much larger is not one.
MAX_CONTROL_BYTES = 4096
_MAX_INT64 = (1 << 63) - 1


class MalformedControlFile(ValueError):
    """The control file does not hold a valid request; the message says why in one line."""


class MalformedSkipsFile(ValueError):
    """The skips file does not hold a valid skip list; the message says why in one line."""


@dataclass(frozen=True)
class ControlFileRequest:
    """The control file: the ranks of `generation` save a checkpoint once `step` has completed."""

    generation: int
    step: int


@dataclass(frozen=True)
class SkipList:
    """The skips file: the sample ranges [start, end) a generation leaves out, as the coordinator sent them."""

    ranges: tuple[tuple[int, int], ...] = ()


def encode_control(request: ControlFileRequest) -> bytes:
    return json.dumps({"schema": SCHEMA, "generation": request.generation,
                       "checkpoint_at_step": request.step}).encode()


def decode_control(data: bytes) -> ControlFileRequest:
    """The request in a control file's bytes; raises MalformedControlFile for anything else."""
    if len(data) > MAX_CONTROL_BYTES:
        raise MalformedControlFile(f"{len(data)} bytes is more than {MAX_CONTROL_BYTES}")
    body = _json(data, MalformedControlFile, "not JSON")
    if not isinstance(body, dict):
        raise MalformedControlFile("not a JSON object")
    _check_schema(body.get("schema"), MalformedControlFile, "schema")
    return ControlFileRequest(_count(body, "generation"), _count(body, "checkpoint_at_step"))


def encode_skips(skips: SkipList) -> bytes:
    return json.dumps({"schema": SCHEMA, "ranges": [[start, end] for start, end in skips.ranges]}).encode()


def decode_skips(data: bytes) -> SkipList:
    """The skip list in a skips file's bytes; raises MalformedSkipsFile for anything else."""
    body = _json(data, MalformedSkipsFile, "the skip ledger is not JSON")
    if not isinstance(body, dict) or set(body) != {"schema", "ranges"}:
        raise MalformedSkipsFile('the skip ledger must be {"schema": 1, "ranges": [[start, end], ...]}')
    _check_schema(body["schema"], MalformedSkipsFile, "skip ledger schema")
    if not isinstance(body["ranges"], list):
        raise MalformedSkipsFile("the skip ledger's ranges must be a list")
    return SkipList(tuple(_skip_range(i, entry) for i, entry in enumerate(body["ranges"])))


def _json(data: bytes, error: type[ValueError], not_json: str) -> Any:
    try:
        return json.loads(data, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, NaN, too many digits, too deep
        raise error(f"{not_json}: {exc}") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"bare {name} is not JSON")


def _check_schema(schema: Any, error: type[ValueError], what: str) -> None:
    if type(schema) is not int or schema != SCHEMA:  # true and 1.0 equal 1 in Python, not on disk
        raise error(f"{what} {schema!r:.40} is not {SCHEMA}")


def _count(body: dict[str, Any], key: str) -> int:
    value = body.get(key)
    if type(value) is not int or not 0 <= value <= _MAX_INT64:  # type(): true is not a step
        raise MalformedControlFile(f"field '{key}' must be an integer from 0 to {_MAX_INT64}, got {value!r:.40}")
    return value


def _skip_range(index: int, entry: Any) -> tuple[int, int]:
    if not (isinstance(entry, list) and len(entry) == 2 and all(type(x) is int for x in entry)):
        raise MalformedSkipsFile(f"skip range #{index} {entry!r:.40} is not a pair of integers [start, end]")
    start, end = entry
    if start < 0:
        raise MalformedSkipsFile(f"skip range #{index} [{start}, {end}] starts before position 0")
    if start >= end:
        raise MalformedSkipsFile(f"skip range #{index} [{start}, {end}] is empty: start must be below end")
    if end > _MAX_INT64:
        raise MalformedSkipsFile(f"skip range #{index} [{start}, {end}] ends after position {_MAX_INT64}")
    return start, end
