"""How often to snapshot into memory when `checkpoint.memory_every_steps` is "auto" (issue 15): as often as
keeps the stall a snapshot causes under STALL_TARGET of the training time.

A snapshot blocks the step loop for `stall` seconds once every N steps of `step` seconds each, so its share
is stall / (N x step); the interval is the smallest N that keeps it at most STALL_TARGET, within
[1, cap]. Both figures are measured by the rank that decides (trainer/runtime/memory_snapshots.py): the
stall of its latest snapshot, and the mean step time since then without that stall. Pure logic: the
clock is given.
"""

from __future__ import annotations

import math

from common.clock import Clock

STALL_TARGET = 0.02
# A generation's first snapshot comes after this many of its steps: the first one (graph compile) is not
# timed, the next ones give the step time, and the snapshot itself gives the stall.
FIRST_SNAPSHOT_AFTER = 5
MAX_INTERVAL = 1000


def interval_for(stall_s: float, step_s: float, cap: int) -> int:
    """The smallest N >= 1 with stall_s / (N * step_s) <= STALL_TARGET, at most `cap`."""
    if step_s <= 0:
        return cap
    needed = math.ceil(stall_s / (STALL_TARGET * step_s) - 1e-9)  # an exact multiple is not rounded up
    return max(1, min(cap, needed))


def interval_cap(disk_every: int | None) -> int:
    """MAX_INTERVAL, or the disk checkpoint interval when that is smaller: a snapshot rarer than the disk
    checkpoints would save nothing they do not."""
    return min(MAX_INTERVAL, disk_every) if disk_every else MAX_INTERVAL


class StepTimes:
    """The mean time of the steps since the last `reset`: from one `step_ended` (or the reset) to the next.
    Before the first reset the first step is not timed (it compiles the graph)."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._mark: float | None = None
        self._total = 0.0
        self._count = 0

    def step_ended(self) -> None:
        now = self._clock.now()
        if self._mark is not None:
            self._total += now - self._mark
            self._count += 1
        self._mark = now

    def mean(self) -> float | None:
        return self._total / self._count if self._count else None

    def reset(self) -> None:
        """Start a new measurement now (after a snapshot: its stall is not a step's time)."""
        self._mark = self._clock.now()
        self._total, self._count = 0.0, 0
