"""Finding checkpoints under a root and judging whether each is complete: its manifest parses and validates
and every file it lists exists with its size. Cheap: no data is read (checksums: see `verify`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from trainer.checkpoint.errors import CheckpointError, CorruptCheckpoint
from trainer.checkpoint.file_access import open_regular_file
from trainer.checkpoint.manifest import FileEntry, Manifest, check_file_name, parse_step_dir, read_manifest


@dataclass(frozen=True)
class CheckpointInfo:
    """One `step_N` directory: its manifest when complete, else what is wrong with it."""

    path: Path
    step: int
    manifest: Manifest | None
    problem: str | None

    @property
    def complete(self) -> bool:
        return self.problem is None


def check_data_file(step_dir: Path, entry: FileEntry) -> None:
    """Refuses a listed file unless it is a regular file of the listed size inside `step_dir`."""
    where = f"{step_dir.name}/{entry.name}"
    check_file_name(entry.name, step_dir.name)
    try:
        fd = open_regular_file(step_dir, entry.name, where)
    except FileNotFoundError as exc:
        raise CorruptCheckpoint(f"{where} is listed in the manifest but missing") from exc
    except OSError as exc:
        raise CorruptCheckpoint(f"{where} cannot be opened: {exc.strerror}") from exc
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size != entry.size:
        raise CorruptCheckpoint(f"{where} is {size} bytes, the manifest says {entry.size} (truncated or replaced)")


def check_inside_root(root: Path, step_dir: Path) -> None:
    """Refuses a step directory that is not inside the checkpoint root once `..` and symbolic links are
    resolved: a path that came from elsewhere (TRAINERD_RESUME_FROM) may name only the job's own checkpoints.
    """
    real_root, real = os.path.realpath(root), os.path.realpath(step_dir)
    if real == real_root or not Path(real).is_relative_to(real_root):
        resolved = "" if real == str(step_dir) else f" (it resolves to {real})"
        raise CheckpointError(f"{step_dir} is not inside the checkpoint directory {root}{resolved}")


def check_complete(step_dir: Path) -> Manifest:
    """The manifest, once it parses, validates and every file it lists exists with its size."""
    manifest = read_manifest(step_dir)
    for entry in manifest.files:
        check_data_file(step_dir, entry)
    return manifest


def inspect(step_dir: Path, step: int) -> CheckpointInfo:
    try:
        return CheckpointInfo(step_dir, step, check_complete(step_dir), None)
    except CorruptCheckpoint as exc:
        return CheckpointInfo(step_dir, step, None, str(exc))


def list_checkpoints(root: Path) -> list[CheckpointInfo]:
    """Every `step_N` directory under `root`, oldest first, each judged complete or not (no data read)."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = parse_step_dir(child.name)
        if step is not None and child.is_dir():
            found.append(inspect(child, step))
    return sorted(found, key=lambda info: info.step)
