"""MindFormers Checkpoint 2.0 seen through the layout model, so that it reshards and exports like ours.

What MindFormers 2.0 writes (`mindformers/checkpoint/checkpoint.py`) under its checkpoint root:

    latest_checkpointed_iteration.txt           the iteration number; rank 0 writes it after every rank's files
    iteration_00000040/                         one directory per saved iteration (Megatron's iter_ also read)
        CKP-model-0000000-0000002.safetensors   rank 0 of 2: its network parameters (CKP-opt-... likewise;
                                                `CKP` is checkpoint.prefix)
        common.json                             global_step, global_batch_size, epoch_num, step_num, loss_scale
        metadata.json                           per parameter: global shape and chunks; per chunk: its files

The tracker file is the commit point: an iteration directory after the one it names may be half written (a
save cut short), and is refused. A run on one device writes no metadata.json: each file then holds whole tensors.
Only headers and JSON are read here; the data stays in place and is read through the usual read plan.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.checkpoint.errors import CheckpointError, CorruptCheckpoint
from trainer.checkpoint.json_fields import MAX_JSON_BYTES
from trainer.checkpoint.layout import Chunk, Region, TensorLayout
from trainer.checkpoint.native_import import safetensors_headers

TRACKER_FILE = "latest_checkpointed_iteration.txt"
# MindFormers 2.0.0 names them iteration_NNNNNNNN (checkpoint/utils.py); Megatron, whose layout it follows, iter_.
_ITERATION_PREFIXES = ("iteration_", "iter_")
_ITERATION_DIR = re.compile(r"(?:iteration|iter)_(\d{8,})")


def iteration_dir(root: Path, iteration: int) -> Path:
    """The directory of `iteration` under `root`: `iteration_NNNNNNNN`, or `iter_NNNNNNNN` when only that exists."""
    for prefix in _ITERATION_PREFIXES:
        path = root / f"{prefix}{iteration:08d}"
        if path.is_dir():
            return path
    return root / f"{_ITERATION_PREFIXES[0]}{iteration:08d}"


def committed_iteration(root: Path) -> int | None:
    """The iteration `root`'s tracker file names, or None when there is no tracker file (nothing committed).
    Raises CorruptCheckpoint when the tracker holds something else than an iteration number."""
    try:
        raw = (root / TRACKER_FILE).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise CorruptCheckpoint(f"cannot read {root / TRACKER_FILE}: {exc}") from exc
    if not raw.isdigit():
        raise CorruptCheckpoint(f"{root / TRACKER_FILE} holds {raw[:40]!r}, not an iteration number")
    return int(raw)


def iteration_of(path: Path) -> int | None:
    """The iteration of an `iteration_NNNNNNNN` (or `iter_NNNNNNNN`) directory name, else None."""
    match = _ITERATION_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


def is_mindformers_checkpoint(path: Path) -> bool:
    """A Checkpoint 2.0 root (it has a tracker file) or one of its iteration directories."""
    return (path / TRACKER_FILE).is_file() or iteration_of(path) is not None


def committed_iteration_dir(path: Path) -> Path:
    """The committed iteration directory `path` stands for. A root resolves to the iteration its tracker
    names. An iteration directory is committed when the tracker names it or a later iteration: MindFormers
    saves iterations in step order and moves the tracker after each, so only one newer than the tracker can
    be a save cut short (a save that overwrites an older iteration after a resume from before it is not
    told apart: trainerd does not resume from an iteration after the one a generation started from)."""
    iteration = iteration_of(path)
    if iteration is None:
        committed = committed_iteration(path)
        if committed is None:
            raise CheckpointError(f"{path} has no {TRACKER_FILE}: no iteration was committed there")
        chosen = iteration_dir(path, committed)
        if not chosen.is_dir():
            raise CheckpointError(f"{path / TRACKER_FILE} names iteration {committed}, but {chosen.name} is missing")
        return chosen
    committed = committed_iteration(path.parent)
    if committed is None or committed < iteration:
        named = "names no iteration" if committed is None else f"names iteration {committed}"
        raise CheckpointError(f"{path} is not committed: {path.parent / TRACKER_FILE} {named} (a save cut short "
                              "leaves such a directory)")
    return path


@dataclass(frozen=True)
class MindFormersCheckpoint:
    """One committed iteration; chunk files are relative to `directory`."""

    directory: Path
    step: int
    consumed_samples: int
    tensors: dict[str, TensorLayout]


def _read_json(path: Path) -> Any:
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise CorruptCheckpoint(f"{path} is {size} bytes, more than {MAX_JSON_BYTES}")
        return json.loads(path.read_bytes())
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpoint(f"{path} is not valid JSON: {exc}") from exc


def read_common(directory: Path) -> tuple[int, int]:
    """(global step, consumed samples) from the iteration's common.json."""
    common = _read_json(directory / "common.json")
    fields = common if isinstance(common, dict) else {}
    step, batch = fields.get("global_step"), fields.get("global_batch_size")
    if not (isinstance(step, int) and isinstance(batch, int) and not isinstance(step, bool)
            and not isinstance(batch, bool) and step >= 0 and batch >= 0):
        raise CorruptCheckpoint(f"{directory / 'common.json'} has no integer global_step and global_batch_size")
    return step, step * batch


def _whole_tensors(directory: Path) -> dict[str, TensorLayout]:
    """A checkpoint without metadata.json (one device): every file holds whole tensors, each name once."""
    files = sorted(p.name for p in directory.glob("*.safetensors") if p.is_file())
    if not files:
        raise CheckpointError(f"{directory} holds no .safetensors file")
    tensors: dict[str, TensorLayout] = {}
    for name in files:
        for key, (dtype, shape) in safetensors_headers(directory, name).items():
            if key in tensors:
                raise CorruptCheckpoint(f"'{key}' is in more than one file of {directory}, which has no metadata.json")
            tensors[key] = TensorLayout(dtype, shape, (Chunk(Region.full(shape), name, key),))
    return tensors


def _shard_id(entry: str) -> tuple[str, tuple[int, ...]] | None:
    """MindFormers keys storage_data by str((param_name, global_offset))."""
    try:
        value = ast.literal_eval(entry)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], tuple)
            and all(isinstance(v, int) for v in value[1])):
        return value[0], value[1]
    return None


def _sharded_tensors(directory: Path, metadata: Any) -> dict[str, TensorLayout]:
    where = f"{directory / 'metadata.json'}"
    if not isinstance(metadata, dict) or not isinstance(metadata.get("state_dict_metadata"), dict) \
            or not isinstance(metadata.get("storage_data"), dict):
        raise CorruptCheckpoint(f"{where} has no state_dict_metadata and storage_data objects")
    files: dict[tuple[str, tuple[int, ...]], str] = {}
    for entry, storages in metadata["storage_data"].items():
        shard = _shard_id(entry)
        if shard is None or not isinstance(storages, list) or not storages or not isinstance(storages[0], dict) \
                or not isinstance(storages[0].get("file_name"), str):
            raise CorruptCheckpoint(f"{where}: storage entry {entry[:80]!r} is not (name, offset) -> files")
        files[shard] = storages[0]["file_name"]
    headers: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    tensors: dict[str, TensorLayout] = {}
    for name, entry in metadata["state_dict_metadata"].items():
        shape = entry.get("global_shape") if isinstance(entry, dict) else None
        chunks = entry.get("chunk") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape) \
                or not isinstance(chunks, list):
            raise CorruptCheckpoint(f"{where}: '{name}' has no global_shape and chunk list")
        dtype = None
        layout_chunks = []
        for chunk in chunks:
            offset = tuple(chunk.get("global_offset", ())) if isinstance(chunk, dict) else ()
            local = tuple(chunk.get("local_shape", ())) if isinstance(chunk, dict) else ()
            file_name = files.get((name, offset))
            if file_name is None or Path(file_name).name != file_name:
                raise CorruptCheckpoint(f"{where}: no file holds '{name}' at offset {list(offset)}")
            if file_name not in headers:
                headers[file_name] = safetensors_headers(directory, file_name)
            held = headers[file_name].get(name)
            # MindFormers writes (0,) as the offset of a whole tensor whatever its rank.
            padded = offset + (0,) * (len(shape) - len(offset)) if offset == (0,) else offset
            if held is None or held[1] != local or len(padded) != len(shape):
                raise CorruptCheckpoint(f"{file_name} does not hold '{name}' as {list(local)} at {list(offset)}")
            if dtype is not None and held[0] != dtype:
                raise CorruptCheckpoint(f"'{name}' is {dtype} in one file and {held[0]} in {file_name}")
            dtype = held[0]
            layout_chunks.append(Chunk(Region(padded, local), file_name, name))
        if dtype is None:
            raise CorruptCheckpoint(f"{where}: '{name}' has no chunk")
        tensors[name] = TensorLayout(dtype, tuple(shape), tuple(layout_chunks))
    return tensors


def import_mindformers(path: Path) -> MindFormersCheckpoint:
    """The committed iteration `path` stands for (a Checkpoint 2.0 root or an iteration directory),
    validated for exact coverage of every tensor."""
    directory = committed_iteration_dir(path)
    step, consumed = read_common(directory)
    metadata = directory / "metadata.json"
    tensors = _sharded_tensors(directory, _read_json(metadata)) if metadata.exists() else _whole_tensors(directory)
    for name, layout in tensors.items():
        layout.validate(name)
    return MindFormersCheckpoint(directory, step, consumed, tensors)
