"""In-memory snapshots: every N steps each rank copies its share of the state into the shared memory
its agent owns (TRAINERD_MEMORY_DIR, on tmpfs), so that a crashed worker loses at most N steps.

A snapshot is a checkpoint in every respect but where it lives: the same writer (`CheckpointWriter`),
the same shard ownership, the same commit (rank 0 writes the manifest last, once every rank's report
is there, so a snapshot torn by a crash is never complete), the same meta (data position, skip ledger)
and the same cells (the guard's state among them). tmpfs makes the writer's fsyncs free. Retention
keeps MEMORY_KEEP complete snapshots, so the memory holds at most two of a rank's state: the newest
complete snapshot and the one being written. The agent reports the newest complete one in its heartbeats; the
coordinator resumes from it when it is newer than the newest disk checkpoint (daemon/job/decide.py).

On one host all ranks of a generation share the directory and rank 0 commits; a generation spanning
hosts writes in scope "host" (below).

A failed snapshot is logged and training goes on: the disk checkpoints remain the fallback.

How often: every `every` steps (global step numbers, so every rank agrees), or, with "auto", as often as
keeps the snapshot's stall under 2% of the step time, at most one per 10 s of training
(trainer/runtime/snapshot_interval.py). Every rank of a generation must snapshot the same steps, or rank 0's
commit waits for a report that never comes. With
"auto" the steps are agreed without a collective:
- the first is the same function of the resume step on every rank (FIRST_SNAPSHOT_AFTER steps in);
- after each snapshot, rank 0 alone measures (the stall of its snapshot, its mean step time since the
  previous one without that stall), chooses the interval, and publishes the next snapshot step in
  PLAN_NAME in the shared directory (written whole, renamed into place) before it starts its next step;
- the other ranks, after each snapshot, read that file at each step until it names the snapshot they
  just took as its predecessor, then take the step it names. The ranks run in lockstep (every step
  has a collective), so no rank finishes step k + 1 before rank 0 has published what it decided at the
  end of step k: the plan is always there in time. A rank that finds the plan names a step it has
  already passed logs it: rank 0's commit of that snapshot then times out (MEMORY_COMMIT_TIMEOUT_S,
  logged too), retention removes it, and the ranks follow the next plan. If rank 0 cannot publish, it
  stops taking snapshots (logged), so none is left waiting for the others.
The agent removes the plan at every launch (it is not a step directory); it also names its generation.

Scope "host" (TRAINERD_MEMORY_SCOPE=host: the generation spans hosts, each agent holds its own ranks'
files): every rank writes its file and its report (with the meta) into its agent's directory and returns;
no rank waits, commits or prunes: the agent finds a step complete on its host from the reports, pins it,
prunes, and assembles a checkpoint from the hosts' files for a relaunch (agent/snapshots/memory_snapshots.py).
With "auto" each rank chooses its own interval, a power of two (the smallest at least `interval_for`'s),
and snapshots the steps that are multiples of it: the intervals of different ranks nest, so the steps
every rank snapshots are the multiples of the largest, with no plan to share.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Literal

import numpy as np

from common.atomic_write import write_atomically
from common.clock import Clock
from trainer.checkpoint import CheckpointError, CheckpointMeta, CheckpointWriter
from trainer.checkpoint.sharding import ShardedTensor
from trainer.runtime.snapshot_interval import FIRST_SNAPSHOT_AFTER, StepTimes, interval_for

log = logging.getLogger(__name__)

MEMORY_KEEP = 1
# Every rank writes into the same local memory: a rank that has not written its share this long after
# rank 0 has died (and the generation with it).
MEMORY_COMMIT_TIMEOUT_S = 60.0
PLAN_NAME = "snapshot_plan.json"  # with "auto": the next snapshot step rank 0 chose


def power_of_two_interval(interval: int, cap: int) -> int:
    """The smallest power of two at least `interval`, or the largest at most `cap` when that is beyond it."""
    power = 1
    while power < interval and power * 2 <= max(cap, 1):
        power *= 2
    return power


class MemorySnapshots:
    """One rank's snapshots into `directory`: after every `every`-th step, or with "auto" at the steps
    rank 0 plans, at most `cap` steps apart. Call `due` after every step, and `snapshotted` after each
    snapshot with the time it blocked the step loop."""

    def __init__(self, directory: Path, every: int | Literal["auto"], rank: int, world_size: int,
                 generation: int, where: str, clock: Clock, cap: int, scope_host: bool = False) -> None:
        if every != "auto" and every < 1:
            raise ValueError(f"the snapshot interval must be at least 1, got {every}")
        self.every = every
        self._directory = directory
        self._rank = rank
        self._generation = generation
        self._where = where
        self._cap = cap
        self._steps = StepTimes(clock)
        self._next: int | None = None  # with "auto": the next snapshot step, None while unknown
        self._last: int | None = None  # with "auto": the last step snapshotted (or resumed from)
        self._stopped = False          # rank 0 could not publish its plan: no more snapshots
        self._scope_host = scope_host
        self._writer = CheckpointWriter(directory, rank, world_size, generation=generation, keep=MEMORY_KEEP,
                                        commit_timeout_s=MEMORY_COMMIT_TIMEOUT_S, commit=not scope_host)

    def due(self, step: int) -> bool:
        if self.every != "auto":
            return step % self.every == 0
        self._steps.step_ended()
        if self._last is None:  # this generation's first step: every rank resumed from the same one
            self._last = step - 1
            self._next = self._last + FIRST_SNAPSHOT_AFTER
        if self._next is None and not self._stopped and self._rank != 0 and not self._scope_host:
            self._follow(step)
        return step == self._next

    def snapshotted(self, step: int, stall_s: float) -> None:
        """The snapshot of `step` blocked the step loop `stall_s` seconds: with "auto", plan the next one
        (rank 0) or wait for rank 0's plan (the others)."""
        if self.every == "auto":
            self._last, self._next = step, None
            if self._scope_host:
                step_s = self._steps.mean()
                interval = power_of_two_interval(
                    interval_for(stall_s, step_s, self._cap) if step_s is not None else self._cap, self._cap)
                self._next = (step // interval + 1) * interval
                log.info("%s: snapshot of step %d stalled %.3f s: the next is at step %d",
                         self._where, step, stall_s, self._next)
            elif self._rank == 0 and not self._stopped:
                step_s = self._steps.mean()
                interval = interval_for(stall_s, step_s, self._cap) if step_s is not None else self._cap
                self._publish(step, step + interval)
                log.info("%s: snapshot of step %d stalled %.3f s, steps take %s: the next is in %d steps",
                         self._where, step, stall_s, "?" if step_s is None else f"{step_s:.3f} s", interval)
            self._steps.reset()

    def save(self, meta: CheckpointMeta, tensors: Mapping[str, np.ndarray], sharded: Mapping[str, ShardedTensor],
             share_into: Path | None = None) -> Future[None] | None:
        """Copy this rank's share and return; the file and the commit are written in the background.
        Waits for the previous snapshot first (a failed one is logged, not raised). With `share_into` (the
        agent's outbox, on the same tmpfs) the share is also placed there (`CheckpointWriter.save_async`).
        Returns the future of this rank's share, None when the snapshot could not start (logged)."""
        self._settle()
        try:
            return self._writer.save_async(meta, tensors, sharded, share_into=share_into)
        except (CheckpointError, OSError) as exc:
            log.warning("%s: could not snapshot step %d into memory: %s", self._where, meta.step, exc)
            return None

    def close(self) -> None:
        self._settle()
        self._writer.close()

    def _publish(self, after: int, next_step: int) -> None:
        path = self._directory / PLAN_NAME
        try:
            plan = {"generation": self._generation, "after": after, "next": next_step}
            write_atomically(path, json.dumps(plan).encode())
        except OSError as exc:
            log.error("%s: cannot publish the next snapshot step to the other ranks (%s): no more in-memory "
                      "snapshots in this generation", self._where, exc)
            self._stopped = True
            return
        self._next = next_step

    def _follow(self, step: int) -> None:
        """Take rank 0's plan once it follows the last snapshot (an older one is not published yet)."""
        assert self._last is not None
        try:
            plan = json.loads((self._directory / PLAN_NAME).read_text())
            generation, after, next_step = plan["generation"], plan["after"], plan["next"]
        except (OSError, ValueError, TypeError, KeyError):
            return
        if generation != self._generation or not isinstance(after, int) or not isinstance(next_step, int):
            return
        if after < self._last:
            return
        if next_step >= step:
            self._next = next_step
            return
        log.warning("%s: rank 0 planned an in-memory snapshot at step %d, which this rank had passed before "
                    "it read the plan: that snapshot will not complete", self._where, next_step)
        self._last = next_step  # the next plan follows that one

    def _settle(self) -> None:
        try:
            self._writer.wait()
        except (CheckpointError, OSError) as exc:
            log.warning("%s: an in-memory snapshot failed: %s", self._where, exc)
