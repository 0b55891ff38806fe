"""How each script's output numbers its epochs, kept across generations and agent restarts.

A script trainerd reads its progress from prints its step within the epoch (LossMonitor); the output
parser (agent/output_progress.py) turns that into the run's own step once an epoch change showed how
many steps an epoch has. A relaunch resumes mid-run, at a later epoch: without what the generation
before learnt, its first epoch would count from step 1 again (status going back, goodput counting the
epoch as lost work). The supervisor keeps what each (job, worker argv, world size) showed here, and
seeds a relaunch's parsers with it.

The shapes are saved in `<work_dir>/epoch_shapes.json` (temporary name, then rename), so that an
agent started again (local agents stop and start with trainerd) still knows them. A file that is not
a regular file, too large, or not what this module writes is ignored with a warning: it only means
the first epoch after a relaunch counts from 1.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

from agent.output_progress import EpochShape
from common.atomic_write import write_atomically

log = logging.getLogger(__name__)

# Shapes kept, the newest learnt last; the oldest goes first.
MAX_EPOCH_SHAPES = 32
MAX_FILE_BYTES = 1 << 20
FILE_NAME = "epoch_shapes.json"

ShapeKey = tuple[str, tuple[str, ...], str]  # (job name, a worker's argv, world size)


class EpochShapes:
    def __init__(self, work_dir: Path) -> None:
        self._path = work_dir / FILE_NAME
        self._shapes: dict[ShapeKey, EpochShape] = _load(self._path)

    def get(self, key: ShapeKey) -> EpochShape | None:
        return self._shapes.get(key)

    def remember(self, key: ShapeKey, shape: EpochShape) -> None:
        if self._shapes.get(key) == shape:
            return
        self._shapes.pop(key, None)
        self._shapes[key] = shape
        while len(self._shapes) > MAX_EPOCH_SHAPES:
            del self._shapes[next(iter(self._shapes))]
        entries = [{"job": job, "argv": list(argv), "world_size": world_size, "first_epoch": s.first_epoch,
                    "steps_per_epoch": s.steps_per_epoch, "zero_based": s.zero_based}
                   for (job, argv, world_size), s in self._shapes.items()]
        try:
            write_atomically(self._path, json.dumps(entries).encode())
        except OSError as exc:  # kept in memory all the same
            log.warning("cannot save %s: %s", self._path, exc)


def _load(path: Path) -> dict[ShapeKey, EpochShape]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log.warning("ignoring %s: %s", path, exc)
        return {}
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_FILE_BYTES:
            log.warning("ignoring %s: not a regular file of at most %d bytes", path, MAX_FILE_BYTES)
            return {}
        data = os.read(fd, MAX_FILE_BYTES)
    finally:
        os.close(fd)
    try:
        entries = json.loads(data)
        shapes = {_key(entry): _shape(entry) for entry in entries}
    except (ValueError, TypeError, KeyError) as exc:
        log.warning("ignoring %s: not what this agent writes (%s)", path, exc)
        return {}
    return dict(list(shapes.items())[-MAX_EPOCH_SHAPES:])


def _key(entry: dict) -> ShapeKey:
    job, argv, world_size = entry["job"], entry["argv"], entry["world_size"]
    if not (isinstance(job, str) and isinstance(world_size, str) and isinstance(argv, list)
            and all(isinstance(word, str) for word in argv)):
        raise TypeError("a key that is not (job, argv, world size)")
    return job, tuple(argv), world_size


def _shape(entry: dict) -> EpochShape:
    first, steps, zero_based = entry["first_epoch"], entry["steps_per_epoch"], entry["zero_based"]
    if (type(first) is not int or first not in (0, 1) or type(steps) is not int or steps < 1
            or type(zero_based) is not bool):
        raise ValueError("an epoch shape out of range")
    return EpochShape(first, steps, zero_based)
