"""Durable writes: data reaches the disk (fsync) before a rename makes it visible under its final name."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    """Makes renames and unlinks inside `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(final: Path) -> Path:
    """Where a file is written before its rename: a dot file the catalog never mistakes for data."""
    return final.with_name(f".{final.name}.tmp")


def publish(tmp: Path, final: Path) -> None:
    """Renames an fsynced `tmp` to `final` (replacing it atomically) and makes the rename durable."""
    os.replace(tmp, final)
    fsync_dir(final.parent)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Writes a JSON document so that readers see either the old file or the whole new one: write, fsync, rename."""
    tmp = temporary_name(path)
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    publish(tmp, path)
