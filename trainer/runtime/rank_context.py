"""Who this process is in the job, read once from the environment the agent launched it with.

Pure (no MindSpore): the agent's tests and a user's script can both build one. A process started
without `MS_ROLE` is a user running the script by hand: a standalone single rank.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Literal

from proto.launch_env import (
    CHECKPOINT_DIR_ENV,
    CHECKPOINT_EVERY_ENV,
    CHECKPOINT_KEEP_ENV,
    CHECKPOINT_OUTBOX_ENV,
    CONTROL_FILE_ENV,
    GENERATION_ENV,
    GLOBAL_BATCH_ENV,
    GRAD_ACCUM_ENV,
    JOB_ENV,
    LOCAL_RANK_ENV,
    MEMORY_DIR_ENV,
    MEMORY_EVERY_ENV,
    MEMORY_SCOPE_ENV,
    MICRO_BATCH_ENV,
    PROGRESS_SOCKET_ENV,
    RESUME_FROM_ENV,
    RESUME_MEMORY_STEP_ENV,
)


class RankContextError(ValueError):
    """The launch environment is missing a variable or holds a malformed one; the message names it."""


class Role(StrEnum):
    SCHEDULER = "MS_SCHED"
    WORKER = "MS_WORKER"
    STANDALONE = "standalone"


# Variables that only mean something in a cluster launch: set without MS_ROLE they betray a broken launch.
_CLUSTER_ONLY = ("MS_SCHED_HOST", "MS_SCHED_PORT", "MS_WORKER_NUM", "RANK_ID", "RANK_SIZE")
_BATCH_VARS = (GLOBAL_BATCH_ENV, MICRO_BATCH_ENV, GRAD_ACCUM_ENV)
_MAX_PORT = 65535
DEFAULT_CHECKPOINT_KEEP = 3


@dataclass(frozen=True)
class BatchSettings:
    """How one optimizer step's global batch is split: global = micro × grad_accum × world size."""

    global_batch: int
    micro_batch: int
    grad_accum: int

    @property
    def per_rank(self) -> int:
        """Samples one rank consumes per optimizer step."""
        return self.micro_batch * self.grad_accum

    @classmethod
    def for_world(cls, global_batch: int, micro_batch: int, world_size: int) -> BatchSettings:
        """Derive the accumulation steps that keep `global_batch` constant at `world_size` ranks."""
        if global_batch < 1 or micro_batch < 1:
            raise ValueError(f"global batch ({global_batch}) and micro batch ({micro_batch}) must be positive")
        per_step = micro_batch * world_size
        if global_batch % per_step:
            raise ValueError(
                f"global batch {global_batch} is not a multiple of micro batch {micro_batch} × {world_size} ranks"
            )
        return cls(global_batch, micro_batch, global_batch // per_step)


@dataclass(frozen=True)
class RankCheckpointSettings:
    """Where and how often to checkpoint, and what to resume from, as the launcher chose.

    Every variable is optional and an empty one counts as unset, so a script run by hand has none
    (its flags may then decide). `every` is None when the launcher did not set it.
    """

    directory: Path | None = None     # TRAINERD_CHECKPOINT_DIR, absolute; None: no checkpoints
    every: int | None = None          # TRAINERD_CHECKPOINT_EVERY: save after every N-th step, 0 only when asked
    keep: int = DEFAULT_CHECKPOINT_KEEP  # TRAINERD_CHECKPOINT_KEEP: complete checkpoints retention keeps
    resume_from: Path | None = None   # TRAINERD_RESUME_FROM: a step directory; None: start fresh
    control_file: Path | None = None  # TRAINERD_CONTROL_FILE: where the agent asks for a checkpoint
    # TRAINERD_MEMORY_DIR: the agent's shared-memory directory for this job's in-memory snapshots
    # (trainer.runtime.memory_snapshots); None: no snapshots.
    memory_directory: Path | None = None
    # TRAINERD_MEMORY_EVERY: snapshot after every N-th step, 0: never, "auto": as often as keeps the stall
    # under 2%, at most one per 10 s of training (trainer.runtime.snapshot_interval)
    memory_every: int | Literal["auto"] = 0
    # TRAINERD_RESUME_MEMORY_STEP: the coordinator chose this step's in-memory snapshot, which the agent
    # names in resume_from; None: resume_from (if any) is a disk checkpoint.
    memory_step: int | None = None
    # TRAINERD_MEMORY_SCOPE=host: the generation spans hosts; each rank writes its snapshot files and
    # report into its own agent's directory, and no rank commits (trainer.runtime.memory_snapshots).
    # Unset or empty: every rank shares one host's directory, rank 0 commits.
    memory_scope_host: bool = False
    # TRAINERD_CHECKPOINT_OUTBOX: the agent saves the disk checkpoints (`checkpoint.saved_by: agent`): each
    # rank writes its share into this directory in the agent's shared memory (trainer.runtime.agent_saves);
    # None: each rank writes its share to the checkpoint directory itself.
    outbox: Path | None = None

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> RankCheckpointSettings:
        directory = env.get(CHECKPOINT_DIR_ENV) or None
        if directory is not None and not os.path.isabs(directory):
            raise RankContextError(f"{CHECKPOINT_DIR_ENV}={directory!r:.80} is not an absolute path")
        memory = env.get(MEMORY_DIR_ENV) or None
        if memory is not None and not os.path.isabs(memory):
            raise RankContextError(f"{MEMORY_DIR_ENV}={memory!r:.80} is not an absolute path")
        outbox = env.get(CHECKPOINT_OUTBOX_ENV) or None
        if outbox is not None and not os.path.isabs(outbox):
            raise RankContextError(f"{CHECKPOINT_OUTBOX_ENV}={outbox!r:.80} is not an absolute path")
        keep = _optional_int(env, CHECKPOINT_KEEP_ENV, minimum=1)
        return cls(
            directory=None if directory is None else Path(directory),
            every=_optional_int(env, CHECKPOINT_EVERY_ENV, minimum=0),
            keep=DEFAULT_CHECKPOINT_KEEP if keep is None else keep,
            resume_from=_optional_path(env, RESUME_FROM_ENV),
            control_file=_optional_path(env, CONTROL_FILE_ENV),
            memory_directory=None if memory is None else Path(memory),
            memory_every="auto" if env.get(MEMORY_EVERY_ENV) == "auto"
            else _optional_int(env, MEMORY_EVERY_ENV, minimum=0) or 0,
            memory_step=_optional_int(env, RESUME_MEMORY_STEP_ENV, minimum=1),
            memory_scope_host=_memory_scope_host(env),
            outbox=None if outbox is None else Path(outbox),
        )

    def resume_root(self) -> Path | None:
        """The directory the checkpoint to resume from must lie in: the memory directory for an in-memory
        snapshot (the agent names one there), else the checkpoint directory."""
        memory, path = self.memory_directory, self.resume_from
        if memory is not None and path is not None and os.path.normpath(path).startswith(
                os.path.normpath(memory).rstrip("/") + "/"):
            return memory
        return self.directory


def _memory_scope_host(env: Mapping[str, str]) -> bool:
    scope = env.get(MEMORY_SCOPE_ENV) or ""
    if scope not in ("", "host"):
        raise RankContextError(f"{MEMORY_SCOPE_ENV}={scope!r:.80} is not 'host' or empty")
    return scope == "host"


@dataclass(frozen=True)
class RankContext:
    """This process's place in the job. `rank`, `local_rank` and `device_id` are None for the scheduler."""

    role: Role
    job: str
    generation: int
    rank: int | None
    world_size: int
    local_rank: int | None
    device_id: int | None
    batch: BatchSettings | None
    progress_socket: str | None
    scheduler_address: str | None
    checkpoints: RankCheckpointSettings = RankCheckpointSettings()

    @property
    def is_scheduler(self) -> bool:
        return self.role is Role.SCHEDULER

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> RankContext:
        env = os.environ if environ is None else environ
        role_value = env.get("MS_ROLE")
        if role_value is None:
            return _standalone(env)
        if role_value not in (Role.SCHEDULER, Role.WORKER):
            raise RankContextError(f"MS_ROLE={role_value!r:.40} is neither MS_SCHED nor MS_WORKER")
        role = Role(role_value)
        host = _required(env, "MS_SCHED_HOST")
        port = _int(env, "MS_SCHED_PORT", minimum=1, maximum=_MAX_PORT)
        world_size = _int(env, "MS_WORKER_NUM", minimum=1)
        job = _required(env, JOB_ENV)
        generation = _int(env, GENERATION_ENV, minimum=0)
        rank = local_rank = device_id = None
        if role is Role.WORKER:
            rank_size = _int(env, "RANK_SIZE", minimum=1)
            if rank_size != world_size:
                raise RankContextError(f"RANK_SIZE={rank_size} differs from MS_WORKER_NUM={world_size}")
            rank = _int(env, "RANK_ID", minimum=0, maximum=world_size - 1)
            local_rank = _int(env, LOCAL_RANK_ENV, minimum=0)
            device_id = _int(env, "DEVICE_ID", minimum=0)
        return cls(
            role=role, job=job, generation=generation, rank=rank, world_size=world_size,
            local_rank=local_rank, device_id=device_id, batch=_batch(env, world_size),
            progress_socket=env.get(PROGRESS_SOCKET_ENV) or None, scheduler_address=f"{host}:{port}",
            checkpoints=RankCheckpointSettings.from_environ(env),
        )


def trainerd_launch(environ: Mapping[str, str] | None = None) -> RankContext | None:
    """This process's context when trainerd launched it, else None: a script run by hand or by msrun, which
    trainerd's add-ons to a script (`trainer.runtime.callback`) then leave alone. The agent sets TRAINERD_JOB
    for every process it launches; msrun sets MS_ROLE but none of trainerd's variables."""
    env = os.environ if environ is None else environ
    return RankContext.from_environ(env) if env.get(JOB_ENV) else None


def _standalone(env: Mapping[str, str]) -> RankContext:
    stray = [name for name in _CLUSTER_ONLY if name in env]
    if stray:
        raise RankContextError(
            f"MS_ROLE is not set but {', '.join(stray)} is: set MS_ROLE for a cluster launch or unset them"
        )
    return RankContext(
        role=Role.STANDALONE, job=env.get(JOB_ENV, "standalone"),
        generation=_int(env, GENERATION_ENV, minimum=0) if GENERATION_ENV in env else 0,
        rank=0, world_size=1, local_rank=0,
        device_id=_int(env, "DEVICE_ID", minimum=0) if "DEVICE_ID" in env else 0,
        batch=_batch(env, 1), progress_socket=env.get(PROGRESS_SOCKET_ENV) or None, scheduler_address=None,
        checkpoints=RankCheckpointSettings.from_environ(env),
    )


def _batch(env: Mapping[str, str], world_size: int) -> BatchSettings | None:
    """The batch split the launcher chose, or None when it chose none (the script's flags decide)."""
    present = [name for name in _BATCH_VARS if name in env]
    if not present:
        return None
    if len(present) != len(_BATCH_VARS):
        missing = [name for name in _BATCH_VARS if name not in env]
        raise RankContextError(
            f"{', '.join(missing)} is not set although {', '.join(present)} is: set all three or none"
        )
    global_batch, micro_batch, grad_accum = (_int(env, name, minimum=1) for name in _BATCH_VARS)
    if global_batch != micro_batch * grad_accum * world_size:
        raise RankContextError(
            f"{GLOBAL_BATCH_ENV}={global_batch} is not {MICRO_BATCH_ENV} × {GRAD_ACCUM_ENV} × world size"
            f" = {micro_batch} × {grad_accum} × {world_size}"
        )
    return BatchSettings(global_batch, micro_batch, grad_accum)


def _required(env: Mapping[str, str], name: str) -> str:
    value = env.get(name)
    if not value:
        raise RankContextError(f"{name} is not set (the trainerd agent sets it for every process it launches)")
    return value


def _int(env: Mapping[str, str], name: str, minimum: int, maximum: int | None = None) -> int:
    raw = _required(env, name)
    try:
        value = int(raw, 10)
    except ValueError:
        raise RankContextError(f"{name}={raw!r:.40} is not an integer") from None
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"from {minimum} to {maximum}" if maximum is not None else f"at least {minimum}"
        raise RankContextError(f"{name}={value} must be {bound}")
    return value


def _optional_int(env: Mapping[str, str], name: str, minimum: int) -> int | None:
    return _int(env, name, minimum) if env.get(name) else None


def _optional_path(env: Mapping[str, str], name: str) -> Path | None:
    value = env.get(name)
    return Path(value) if value else None
