"""The manifest: the commit record of one checkpoint directory, and the rules for paths inside it.

`step_{N:08d}/manifest.json` is written last (write, fsync, rename). It records the training position
(`CheckpointMeta`), the world size that wrote it, every data file with its size and digest, and the layout of
every tensor. Every file name it contains is a plain relative path (`check_file_name`); files are opened
without following symbolic links (`file_access`), so none leads outside the checkpoint directory.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.checkpoint.digest import DIGEST_ALGORITHM
from trainer.checkpoint.errors import CheckpointError, CorruptCheckpoint
from trainer.checkpoint.json_fields import (
    as_int,
    check_schema,
    get_field,
    get_int,
    get_list,
    get_str,
    read_json_file,
)
from trainer.checkpoint.layout import TensorLayout, itemsize, layouts_from_json

MANIFEST_NAME = "manifest.json"
_STEP_DIR = re.compile(r"step_(\d{8,})")
_NAME_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")
_MAX_NAME_PARTS = 4
_MAX_SEED = (1 << 64) - 1


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a checkpoint directory name, or None when the name is not one."""
    match = _STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def check_file_name(name: str, where: str) -> None:
    """Refuses names that could leave the checkpoint directory: absolute, '..', hidden or odd characters."""
    parts = name.split("/")
    if len(parts) > _MAX_NAME_PARTS or not all(_NAME_PART.fullmatch(p) for p in parts):
        raise CorruptCheckpoint(f"{where}: file name {name!r:.120} is not a plain relative path inside the checkpoint")


@dataclass(frozen=True)
class EpochPosition:
    """A place in Model.train's epochs: `completed` epochs done and `steps_done` steps of the next, in epochs
    of `steps_per_epoch` steps."""

    completed: int
    steps_done: int
    steps_per_epoch: int

    def at(self, steps_per_epoch: int) -> tuple[int, int]:
        """The same place in epochs of `steps_per_epoch` steps: (epochs completed, steps of the next one done),
        the same share of the epoch done, rounded down; unchanged when the epoch length is."""
        return self.completed, self.steps_done * steps_per_epoch // self.steps_per_epoch

    def to_json(self) -> tuple[int, int, int]:
        return self.completed, self.steps_done, self.steps_per_epoch

    @staticmethod
    def from_json(value: Any, where: str) -> EpochPosition:
        if not isinstance(value, list) or len(value) != 3:
            raise CorruptCheckpoint(f"{where} must be [completed, steps_done, steps_per_epoch]")
        steps_per_epoch = as_int(value[2], f"{where}: steps_per_epoch", minimum=1)
        return EpochPosition(as_int(value[0], f"{where}: completed"),
                             as_int(value[1], f"{where}: steps_done", maximum=steps_per_epoch - 1), steps_per_epoch)


@dataclass(frozen=True)
class CheckpointMeta:
    """Where training stands at the saved step; the worker runtime fills it, the coordinator reads it."""

    step: int
    consumed_samples: int
    data_seed: int
    grad_accumulation: int = 1
    # Any JSON value: the random generators' states as the runtime chooses to record them.
    rng_state: Any = None
    # Half-open global sample ranges [start, stop) that training skips.
    skip_ledger: tuple[tuple[int, int], ...] = ()
    # Where Model.train stood in its epochs (trainer.runtime.callback): epochs completed, steps of the next
    # one trained, and steps per epoch at the time, which a world size without a fixed global batch changes.
    # None for a step loop of the script's own (and in manifests written before it was kept).
    epoch_position: EpochPosition | None = None

    def to_json(self) -> dict[str, Any]:
        out = {
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "data_seed": self.data_seed,
            "grad_accumulation": self.grad_accumulation,
            "rng_state": self.rng_state,
            "skip_ledger": [list(r) for r in self.skip_ledger],
        }
        if self.epoch_position is not None:
            out["epoch_position"] = list(self.epoch_position.to_json())
        return out

    @staticmethod
    def from_json(obj: dict[str, Any], where: str) -> CheckpointMeta:
        ledger = []
        for i, entry in enumerate(get_list(obj, "skip_ledger", where)):
            if not isinstance(entry, list) or len(entry) != 2:
                raise CorruptCheckpoint(f"{where}: skip_ledger entry {i} must be [start, stop]")
            start = as_int(entry[0], f"{where}: skip_ledger entry {i}")
            stop = as_int(entry[1], f"{where}: skip_ledger entry {i}", minimum=start)
            ledger.append((start, stop))
        return CheckpointMeta(
            step=get_int(obj, "step", where),
            consumed_samples=get_int(obj, "consumed_samples", where),
            data_seed=get_int(obj, "data_seed", where, maximum=_MAX_SEED),
            grad_accumulation=get_int(obj, "grad_accumulation", where, minimum=1),
            rng_state=get_field(obj, "rng_state", where),
            skip_ledger=tuple(ledger),
            epoch_position=None if obj.get("epoch_position") is None else
            EpochPosition.from_json(obj["epoch_position"], f"{where}: epoch_position"),
        )

    def check(self) -> None:
        """Raises CheckpointError for values a manifest cannot hold (a negative step, an rng_state that is not JSON)."""
        try:
            CheckpointMeta.from_json(json.loads(json.dumps(self.to_json(), allow_nan=False)), "checkpoint meta")
        except (TypeError, ValueError, CorruptCheckpoint) as exc:
            raise CheckpointError(f"checkpoint meta cannot be saved: {exc}") from exc


@dataclass(frozen=True)
class FileEntry:
    """A data file of the checkpoint: its name relative to the step directory, size in bytes and digest."""

    name: str
    size: int
    digest: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "digest": self.digest}

    @staticmethod
    def from_json(obj: Any, where: str) -> FileEntry:
        if not isinstance(obj, dict):
            raise CorruptCheckpoint(f"{where} must be an object")
        entry = FileEntry(get_str(obj, "name", where), get_int(obj, "size", where), get_str(obj, "digest", where))
        check_file_name(entry.name, where)
        return entry


@dataclass(frozen=True)
class Manifest:
    """The committed description of one checkpoint."""

    meta: CheckpointMeta
    world_size: int
    generation: int
    files: tuple[FileEntry, ...]
    tensors: dict[str, TensorLayout] = field(hash=False)
    digest_algorithm: str = DIGEST_ALGORITHM

    @property
    def step(self) -> int:
        return self.meta.step

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": 1,
            **self.meta.to_json(),
            "world_size": self.world_size,
            "generation": self.generation,
            "digest_algorithm": self.digest_algorithm,
            "files": [f.to_json() for f in self.files],
            "tensors": {name: t.to_json() for name, t in sorted(self.tensors.items())},
        }

    @staticmethod
    def from_json(obj: dict[str, Any], where: str = MANIFEST_NAME) -> Manifest:
        """Parses and validates a manifest; raises CorruptCheckpoint naming the first problem."""
        check_schema(obj, where)
        algorithm = get_str(obj, "digest_algorithm", where)
        if algorithm != DIGEST_ALGORITHM:
            raise CorruptCheckpoint(f"{where}: digest algorithm {algorithm!r:.40} is not supported")
        manifest = Manifest(
            meta=CheckpointMeta.from_json(obj, where),
            world_size=get_int(obj, "world_size", where, minimum=1),
            generation=get_int(obj, "generation", where),
            files=tuple(
                FileEntry.from_json(f, f"{where}: file {i}") for i, f in enumerate(get_list(obj, "files", where))
            ),
            tensors=layouts_from_json(obj, where),
            digest_algorithm=algorithm,
        )
        manifest.validate(where)
        return manifest

    def validate(self, where: str = MANIFEST_NAME) -> None:
        """Every layout exact, every chunk in a listed file under a unique key, no file asked for more bytes
        than it has.
        """
        names = Counter(f.name for f in self.files)
        for name, count in names.items():
            if count > 1:
                raise CorruptCheckpoint(f"{where}: file {name} is listed {count} times")
        claimed = dict.fromkeys(names, 0)
        seen_keys: set[tuple[str, str]] = set()
        for tensor_name, layout in self.tensors.items():
            layout.validate(tensor_name)
            for chunk in layout.chunks:
                if chunk.file not in claimed:
                    raise CorruptCheckpoint(
                        f"{where}: tensor '{tensor_name}' is stored in {chunk.file}, which is not listed"
                    )
                if (chunk.file, chunk.key) in seen_keys:
                    raise CorruptCheckpoint(f"{where}: key '{chunk.key}' of {chunk.file} is used twice")
                seen_keys.add((chunk.file, chunk.key))
                claimed[chunk.file] += chunk.region.volume * itemsize(layout.dtype)
        for entry in self.files:
            if claimed[entry.name] > entry.size:
                raise CorruptCheckpoint(
                    f"{where}: {entry.name} is {entry.size} bytes but its chunks need {claimed[entry.name]}"
                )


def read_manifest(step_dir: Path) -> Manifest:
    """The validated manifest of a checkpoint directory; CorruptCheckpoint when missing or invalid."""
    where = f"{step_dir.name}/{MANIFEST_NAME}"
    return Manifest.from_json(read_json_file(step_dir / MANIFEST_NAME, where), where)

