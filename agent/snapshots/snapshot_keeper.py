"""What the agent does with a generation's in-memory snapshots (issue 15), beside running its processes.

At a Launch (`launch_env`, after the previous generation's processes stopped):
- prepares the job's directory in shared memory (agent/snapshots/memory_snapshots.py), in scope host when the
  generation spans hosts (TRAINERD_MEMORY_SCOPE=host: each host holds its own ranks' files);
- for a generation that resumes from a snapshot (TRAINERD_RESUME_MEMORY_STEP), names it to the workers
  (TRAINERD_RESUME_FROM): the one committed here for a one-host snapshot, else the checkpoint assembled
  under `.resume/` from the ranks' files held here and those fetched from the holders the Launch names
  (`snapshot_sources`), verified against the ranks' reports. When that fails it raises SnapshotUnavailable:
  the workers are never started on it (a worker given no snapshot once trained on from the step it was told),
  but reported exited 65 (the checkpoint cannot be loaded), so the coordinator marks the step bad and
  relaunches from the next newest source;
- starts the ring copier (agent/snapshots/peer_copier.py) of the node the Launch names in `copy_from`, so that this
  host holds a second copy of that node's own ranks' files;
- with `checkpoint.saved_by: agent` (TRAINERD_CHECKPOINT_SAVED_BY), makes the generation's outbox, names it
  to the workers (TRAINERD_CHECKPOINT_OUTBOX) and starts the persister that saves it to disk
  (agent/snapshots/checkpoint_persister.py); without a usable outbox the workers save their checkpoints themselves.
The copier and the persister run until the generation is stopped (`stop_generation`).
Heartbeats and Stop confirmations carry what is held here (`reports`): the newest committed snapshot of
a one-host generation, or, in scope host, every step held with the ranks held of it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.commands import Launch, PeerAgent
from agent.snapshots.checkpoint_persister import CheckpointPersister, Outbox, PersistedSave, UnpersistedSave
from agent.snapshots.memory_snapshots import (
    MANIFEST_NAME,
    OUTBOX_DIR,
    HostScope,
    MemoryDirError,
    MemorySnapshotDir,
    SnapshotAssemblyError,
)
from agent.snapshots.peer_client import NotServedYet, PeerClient
from agent.snapshots.peer_copier import PeerCopier
from proto import trainerd_pb2 as pb
from proto.launch_env import (
    CHECKPOINT_DIR_ENV,
    CHECKPOINT_KEEP_ENV,
    CHECKPOINT_OUTBOX_ENV,
    CHECKPOINT_SAVED_BY_ENV,
    MEMORY_DIR_ENV,
    MEMORY_EVERY_ENV,
    MEMORY_SCOPE_ENV,
    RESUME_FROM_ENV,
    RESUME_MEMORY_STEP_ENV,
    RESUME_STEP_ENV,
)

log = logging.getLogger(__name__)

# How long a relaunch waits for one rank's files from a peer before it gives up on the snapshot.
FETCH_TIMEOUT_S = 120.0
# A holder serves the nodes its newest Launch names, and the Launch of this generation is sent to it as to us:
# when ours came first, its refusal (NotServedYet) is asked again a few times before the snapshot is given up.
NOT_SERVED_ATTEMPTS = 10
NOT_SERVED_PAUSE_S = 0.5


class SnapshotUnavailable(Exception):
    """The in-memory snapshot a generation resumes from cannot be had here (one line: which, and why)."""


@dataclass(frozen=True)
class HeldReports:
    """What a heartbeat or a Stop confirmation says is held here."""

    newest: pb.MemorySnapshot | None = None      # a one-host generation's newest committed snapshot
    held: tuple[pb.MemorySnapshot, ...] = ()     # scope host: each step held, with its ranks held here


class SnapshotKeeper:
    """`memory`: this host's snapshot directory; `peers`: the client of the other agents' SnapshotPeer
    services (None: this agent serves none, and takes part in no snapshot spanning hosts), cloned for each
    relaunch's fetches and each copier, so that no channel outlives its use. `on_saved` and `on_failed` hear,
    on the event loop, of the checkpoints the agent saves for the workers (`checkpoint.saved_by: agent`)."""

    def __init__(self, memory: MemorySnapshotDir, peers: PeerClient | None = None, *,
                 on_saved: Callable[[pb.CheckpointSaved], None] = lambda saved: None,
                 on_failed: Callable[[pb.CheckpointFailed], None] = lambda failed: None) -> None:
        self.memory = memory
        self._peers = peers
        self._on_saved = on_saved
        self._on_failed = on_failed
        self._job = ""
        self._host_scope = False
        self._copier: PeerCopier | None = None
        self._persister: CheckpointPersister | None = None

    async def launch_env(self, launch: Launch) -> dict[str, str]:
        """The workers' snapshot variables for `launch` (TRAINERD_MEMORY_EVERY=0 when they take none), and
        their outbox when the agent saves their checkpoints."""
        await self.stop_generation()
        env = dict(launch.processes[0].env) if launch.processes else {}
        every, memory_step = env.get(MEMORY_EVERY_ENV, ""), env.get(RESUME_MEMORY_STEP_ENV, "")
        resume = env.get(RESUME_STEP_ENV, "")
        host = _host_scope(launch, env)
        self._job, self._host_scope = launch.job_name, host is not None
        try:  # also without snapshots: those of an abandoned future must not be reported later
            directory = self.memory.prepare(launch.job_name, int(resume) if resume.isdigit() else None, host)
        except MemoryDirError as exc:
            log.error("generation %d of job %s takes no in-memory snapshots: %s", launch.generation,
                      launch.job_name, exc)
            if memory_step:
                raise SnapshotUnavailable(f"the in-memory snapshot of step {memory_step} cannot be had here: "
                                          f"{exc}") from None
            return {MEMORY_EVERY_ENV: "0"}
        outbox_env = self._start_persisting(launch, env, directory)
        if every in ("", "0") and not memory_step:
            return {MEMORY_EVERY_ENV: "0", **outbox_env}
        memory_env = {MEMORY_DIR_ENV: str(directory), **outbox_env}
        if memory_step:
            if not memory_step.isdigit():
                raise SnapshotUnavailable(f"the in-memory snapshot to resume from names no step: {memory_step!r:.40}")
            memory_env[RESUME_FROM_ENV] = str(await self._resume_path(launch, int(memory_step)))
        if host is not None and every not in ("", "0") and launch.copy_from is not None:
            self._start_copying(launch.job_name, launch.copy_from, host.world_size)
        return memory_env

    async def _resume_path(self, launch: Launch, step: int) -> Path:
        """Where the workers read the snapshot of `step`.

        Raises:
            SnapshotUnavailable: it cannot be had here (not held, a holder unreachable, a file that fails
                verification against its rank's report).
        """
        job = launch.job_name
        if not launch.snapshot_sources:
            path = self.memory.resume_path(job, step)
            if not (path / MANIFEST_NAME).is_file():
                raise self._unavailable(launch, step, "it is not held here (no committed manifest)")
            return path
        holders = {source.rank: source.holder for source in launch.snapshot_sources}
        world_size = len(holders)
        if sorted(holders) != list(range(world_size)):
            raise self._unavailable(launch, step, f"the Launch names holders of ranks {sorted(holders)!r:.200}, "
                                                  f"not of each rank once")
        # A client of its own, closed after: the holders' addresses change as agents restart (their port is
        # the system's choice), so channels kept from one relaunch to the next would only pile up.
        peers = None if self._peers is None else self._peers.clone()

        def fetch(rank: int, directory: Path) -> None:
            if peers is None:
                raise SnapshotAssemblyError("this agent serves no snapshot peers, so it fetches from none")
            for attempt in range(NOT_SERVED_ATTEMPTS):
                try:
                    return peers.fetch_rank(holders[rank], job, step, rank, directory, FETCH_TIMEOUT_S)
                except NotServedYet:
                    if attempt == NOT_SERVED_ATTEMPTS - 1:
                        raise
                    threading.Event().wait(NOT_SERVED_PAUSE_S)

        try:
            return await asyncio.to_thread(self.memory.assemble, job, step, world_size, fetch)
        except SnapshotAssemblyError as exc:
            raise self._unavailable(launch, step, str(exc)) from None
        finally:
            if peers is not None:
                peers.close()

    @staticmethod
    def _unavailable(launch: Launch, step: int, why: str) -> SnapshotUnavailable:
        log.error("generation %d of job %s cannot resume from the in-memory snapshot of step %d: %s",
                  launch.generation, launch.job_name, step, why)
        return SnapshotUnavailable(f"cannot resume from the in-memory snapshot of step {step}: {why}")

    def _start_copying(self, job: str, source: PeerAgent, world_size: int) -> None:
        if self._peers is None:
            return
        try:
            copier = PeerCopier(self.memory, self._peers.clone(), job, source, max_ranks=world_size)
        except ValueError as exc:
            log.error("job %s: not copying the in-memory snapshots of %r: %s", job, source.node[:80], exc)
            return
        copier.start()
        self._copier = copier
        log.info("job %s: copying the in-memory snapshots of node %s (%s)", job, source.node, source.address)

    def _start_persisting(self, launch: Launch, env: dict[str, str], directory: Path) -> dict[str, str]:
        """With `checkpoint.saved_by: agent`, the outbox made and its persister started: the variable naming
        it to the workers (none when the agent cannot save for them: they then save themselves)."""
        if env.get(CHECKPOINT_SAVED_BY_ENV) != "agent":
            return {}
        checkpoint_dir, world_size, keep = (env.get(name, "") for name in (
            CHECKPOINT_DIR_ENV, "RANK_SIZE", CHECKPOINT_KEEP_ENV))
        ranks = tuple(sorted(spec.rank for spec in launch.processes if spec.role == "worker"))
        if not (os.path.isabs(checkpoint_dir) and world_size.isdigit() and keep.isdigit() and ranks):
            return {}
        outbox = Outbox(directory / OUTBOX_DIR, Path(checkpoint_dir), ranks, int(world_size), launch.generation,
                        max(1, int(keep)), self.memory.user)
        try:
            self.memory.make_dir(outbox.directory)
        except OSError as exc:
            log.error("generation %d of job %s: the workers save their own checkpoints, for the agent cannot "
                      "make their outbox: %s", launch.generation, launch.job_name, exc)
            return {}
        loop = asyncio.get_running_loop()

        def saved(done: PersistedSave) -> None:
            loop.call_soon_threadsafe(self._on_saved, pb.CheckpointSaved(
                generation=done.generation, step=done.step, consumed_samples=done.consumed_samples,
                path=str(done.path)))

        def failed(failure: UnpersistedSave) -> None:
            loop.call_soon_threadsafe(self._on_failed, pb.CheckpointFailed(
                generation=failure.generation, rank=failure.rank, step=failure.step, reason=failure.reason))

        self._persister = CheckpointPersister(outbox, saved, failed)
        self._persister.start()
        return {CHECKPOINT_OUTBOX_ENV: str(outbox.directory)}

    async def stop_generation(self) -> None:
        """The generation is over: its peer copies and the saving of its outbox stop."""
        copier, self._copier = self._copier, None
        persister, self._persister = self._persister, None
        if copier is not None:
            await asyncio.to_thread(copier.stop)
        if persister is not None:
            await asyncio.to_thread(persister.stop)

    async def drop(self, job: str) -> None:
        """The job completed: its snapshots go."""
        await self.stop_generation()
        self.memory.drop(job)

    def reports(self) -> HeldReports:
        """What is held here of the current job; the newest complete snapshot is pinned first."""
        if not self._job:
            return HeldReports()
        newest = self.memory.newest(self._job)
        if self._host_scope:
            return HeldReports(held=tuple(self.memory.held(self._job)))
        if newest is None:
            return HeldReports()
        return HeldReports(newest=pb.MemorySnapshot(step=newest.step, consumed_samples=newest.consumed_samples))


def _host_scope(launch: Launch, env: dict[str, str]) -> HostScope | None:
    """The generation spans hosts: this host's workers' ranks, of the world size, in this generation."""
    world_size = env.get("RANK_SIZE", "")
    if env.get(MEMORY_SCOPE_ENV) != "host" or not world_size.isdigit():
        return None
    ranks = tuple(sorted(spec.rank for spec in launch.processes if spec.role == "worker"))
    return HostScope(ranks, int(world_size), launch.generation)
