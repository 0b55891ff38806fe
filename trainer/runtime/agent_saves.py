"""Disk checkpoints the agent writes (`checkpoint.saved_by: agent`): this rank's share of each save goes
into the outbox in the agent's shared memory (TRAINERD_CHECKPOINT_OUTBOX), and the agent copies it to the
checkpoint directory, verifies it, commits it and reports it (agent/snapshots/checkpoint_persister.py).

The share is what the rank would have written to the checkpoint directory: `CheckpointWriter(commit=False)`
writes its data file and its report (with the save's meta). The step loop waits only while the tensors are
copied to host buffers (`save_async`); the buffers are written into the outbox in the writer's thread.
With in-memory snapshots on, a disk save is taken from the snapshot of the same step instead
(`hand_over_snapshot`): the snapshot's writer writes the rank's share once, into the agent's memory, and
links it into the outbox, so the step waits for one copy, not two.
Before the next save, and before the worker exits, the rank waits for the agent to take its previous share
out of the outbox: at most one share per rank is in memory, and a job completes only once its last
checkpoint is on disk. An agent that has not taken a share within TAKE_TIMEOUT_S is taken to be gone: the
rank's files are removed and the save reported failed, so memory does not fill and training goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from common.clock import Clock
from trainer.checkpoint import CheckpointError, CheckpointMeta, CheckpointWriter
from trainer.checkpoint.commit import report_name
from trainer.checkpoint.manifest import step_dir_name
from trainer.checkpoint.rank_file import rank_file_name
from trainer.checkpoint.sharding import ShardedTensor

log = logging.getLogger(__name__)

# As long as rank 0's writer waits for the other ranks' shares of a save.
TAKE_TIMEOUT_S = 600.0
_POLL_S = 0.01


class ShareNotSaved(CheckpointError):
    """The share of `step` handed to the agent will not be saved (the message says why)."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(f"step {step}: {message}")
        self.step = step


class AgentSaves:
    """This rank's shares of disk checkpoints, handed to its agent through `outbox`."""

    def __init__(self, outbox: Path, rank: int, world_size: int, generation: int, where: str, clock: Clock,
                 take_timeout_s: float = TAKE_TIMEOUT_S) -> None:
        self._outbox = outbox
        self._rank = rank
        self._where = where
        self._clock = clock
        self._take_timeout_s = take_timeout_s
        self._writer = CheckpointWriter(outbox, rank, world_size, generation=generation, commit=False)
        # The step of the share handed to the agent and not yet taken, and the future of its writing.
        self._handed: tuple[int, Future[None]] | None = None

    @property
    def outbox(self) -> Path:
        return self._outbox

    def save(self, meta: CheckpointMeta, tensors: Mapping[str, np.ndarray],
             sharded: Mapping[str, ShardedTensor]) -> None:
        """Wait until the agent took the previous share (`settle`), then copy this one and return (it is
        written in the background). Raises ShareNotSaved for the previous share (this one is then not
        started: call `settle` first to tell the two apart), CheckpointError or OSError for this one."""
        self.settle()
        self._handed = (meta.step, self._writer.save_async(meta, tensors, sharded))

    def hand_over_snapshot(self, step: int, written: Future[None]) -> None:
        """The share of `step` is being placed in the outbox by the in-memory snapshot of that step
        (`MemorySnapshots.save(share_into=self.outbox)`), done when `written` is; call `settle` first."""
        assert self._handed is None, "settle the previous share first"
        self._handed = (step, written)

    def settle(self) -> None:
        """Wait for the share in flight to be written and taken by the agent (at most `take_timeout_s`).
        Raises ShareNotSaved when it could not be written or was not taken in time."""
        if self._handed is None:
            return
        (step, written), self._handed = self._handed, None
        try:
            self._writer.wait()  # idle when the snapshot placed the share; else the same outcome as `written`
            written.result()
        except (CheckpointError, OSError) as exc:
            raise ShareNotSaved(step, f"could not hand this rank's share to the agent: {exc}") from exc
        share = self._outbox / step_dir_name(step)
        deadline = self._clock.now() + self._take_timeout_s
        while (share / report_name(self._rank)).exists():
            if self._clock.now() >= deadline:
                for name in (report_name(self._rank), rank_file_name(self._rank)):
                    (share / name).unlink(missing_ok=True)
                raise ShareNotSaved(step, f"the agent did not take this rank's share within "
                                          f"{self._take_timeout_s:g} s; removed, not saved")
            self._clock.sleep(_POLL_S)

    def close(self) -> None:
        try:
            self.settle()
        finally:
            self._writer.close()
