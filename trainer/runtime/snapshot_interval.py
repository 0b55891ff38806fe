"""How often to snapshot into memory when `checkpoint.memory_every_steps` is "auto" (issue 15): as often as
keeps the stall a snapshot causes under STALL_TARGET of the training time, and no more often than once every
MIN_PERIOD_S of training.

A snapshot blocks the step loop for `stall` seconds once every N steps of `step` seconds each, so its share
is stall / (N x step); the interval is the smallest N that keeps it at most STALL_TARGET and spans at least
MIN_PERIOD_S, within [1, cap]. Both figures are measured by the rank that decides
(trainer/runtime/memory_snapshots.py): the stall of its latest snapshot, and the mean step time since then
without that stall. Pure logic: the clock is given.

Why a floor in time: a snapshot costs more than its stall. Off the step path the agents commit it, report
it and copy it to a peer, a fixed cost per snapshot whatever its size, on cores the workers may share. With
the stall rule alone a small, fast model (the Transformer example: 1.2 MB, 0.15 s steps) was snapshotted
every 2 steps, and on the 2-core cluster-in-a-box its productive time grew by 23% (bench/goodput.py,
fault-free, snapshots on against off). Young's rule for the best checkpoint interval, sqrt(2 x cost x time
between faults), gives 6.5 s for that cost (about 0.07 s of training a snapshot) at a fault every 5 minutes,
and longer for rarer faults; a snapshot more often than a relaunch takes (several seconds) saves less than it
costs. A model whose snapshot stalls longer is held by the stall rule, which then asks for a longer interval.
"""

from __future__ import annotations

import math

from common.clock import Clock

STALL_TARGET = 0.02
MIN_PERIOD_S = 10.0
# A generation's first snapshot comes after this many of its steps: the first one (graph compile) is not
# timed, the next ones give the step time, and the snapshot itself gives the stall.
FIRST_SNAPSHOT_AFTER = 5
MAX_INTERVAL = 1000


def interval_for(stall_s: float, step_s: float, cap: int) -> int:
    """The smallest N >= 1 with stall_s / (N * step_s) <= STALL_TARGET and N * step_s >= MIN_PERIOD_S, at
    most `cap`."""
    if step_s <= 0:
        return cap
    # An exact multiple is not rounded up.
    needed = max(math.ceil(stall_s / (STALL_TARGET * step_s) - 1e-9), math.ceil(MIN_PERIOD_S / step_s - 1e-9))
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
