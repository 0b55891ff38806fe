"""The skip ledger: the global sample ranges every generation of a job leaves out.

A range is a half-open interval [start, end) of sample positions (see `trainer.data.sampler`). The
coordinator adds the range of a batch that spoiled training; the agent hands the ledger to the workers
in TRAINERD_SKIPS_FILE (its format is `proto.worker_files`), and a checkpoint records the ledger it was
trained under (`CheckpointMeta.skip_ledger`). Pure Python: no numpy, no MindSpore.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proto.worker_files import MalformedSkipsFile, decode_skips


@dataclass(frozen=True)
class SkipRanges:
    """Sorted, disjoint, non-adjacent ranges (overlapping or touching ranges are merged)."""

    ranges: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, ranges: Iterable[Any]) -> SkipRanges:
        """Validate and normalise: each range a pair of integers 0 <= start < end; ValueError names a bad one."""
        checked = []
        for i, entry in enumerate(ranges):
            if isinstance(entry, (str, bytes)) or not isinstance(entry, Iterable):
                raise ValueError(f"skip range #{i} {entry!r} is not a pair [start, end]")
            pair = list(entry)
            if len(pair) != 2 or not all(_is_int(x) for x in pair):
                raise ValueError(f"skip range #{i} {entry!r} is not a pair of integers [start, end]")
            start, end = int(pair[0]), int(pair[1])
            if start < 0:
                raise ValueError(f"skip range #{i} [{start}, {end}] starts before position 0")
            if start >= end:
                raise ValueError(f"skip range #{i} [{start}, {end}] is empty: start must be below end")
            checked.append((start, end))
        merged: list[tuple[int, int]] = []
        for start, end in sorted(checked):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        return cls(tuple(merged))

    @classmethod
    def read(cls, path: str | Path) -> SkipRanges:
        """The ledger in a TRAINERD_SKIPS_FILE; a missing file is an empty ledger. ValueError names the file."""
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError:
            return cls()
        except OSError as exc:
            raise ValueError(f"{path}: cannot read the skip ledger: {exc}") from exc
        try:
            return cls.of(decode_skips(data).ranges)
        except MalformedSkipsFile as exc:
            raise ValueError(f"{path}: {exc}") from exc

    def to_json(self) -> list[list[int]]:
        return [[start, end] for start, end in self.ranges]


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
