"""MindSpore's compile cache for every training process, in a directory per job configuration.

The first step of a generation compiles the training graph (about 1 s for the example MLP, much
more for real models). With MS_COMPILER_CACHE_ENABLE=1 and MS_COMPILER_CACHE_PATH, MindSpore saves
the compiled graph (under rank_<RANK_ID>/) and a later start loads it instead. MindSpore 2.10
reuses a cached graph without checking shapes or constants, only the Python sources, so the
directory must change whenever the graph may: it is keyed on the argv, the working directory and
the process's whole environment except what changes every generation without touching the graph
(the scheduler's address, the generation number and its files, the resume point, from disk or from
memory). That covers the world size (MS_WORKER_NUM, RANK_SIZE), the batch split (TRAINERD_GLOBAL_BATCH,
_MICRO_BATCH, _GRAD_ACCUM), the rank and any variable the job itself sets. A job that sets either
variable itself keeps its own setting.

Off unless the agent file or flag asks for it (agent/config.py), since two kinds of script must not use it:
- a functional training step (`value_and_grad` and an optimizer call, MindSpore's tutorials' style, and
  trainerd's TrainerdLoop): MindSpore 2.10 runs it from the cache with parameters it never set, and the loss
  is NaN or ~1e27 from the first step of every later start, resumed or not
  (tests/agent/test_compile_cache_hazard.py keeps that fact checked); a step that is a Cell (Model.train,
  TrainOneStepCell) is unaffected;
- a script whose graph depends on the resume point (a constant built from the resume step).

Every start touches its directory; beyond KEPT_CACHES directories (new world sizes, batch splits, jobs),
the least recently used are removed, so that weeks of elastic jobs do not fill the agent's disk with
graphs (a large model's are large). KEPT_CACHES is well above the processes one host runs at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from agent.launcher import ProcessHandle, ProcessLauncher
from agent.worker_user import WorkerUser
from proto.launch_env import (
    CONTROL_FILE_ENV,
    GENERATION_ENV,
    RESUME_FROM_ENV,
    RESUME_MEMORY_STEP_ENV,
    RESUME_SAMPLES_ENV,
    RESUME_STEP_ENV,
    SKIPS_FILE_ENV,
)

# Set anew for every generation; none of them shapes the graph of trainerd's runtime or examples. One
# missed here costs every generation that sets it a whole compile (the resume step of a relaunch from
# memory did: each such relaunch of the Transformer example on 3 ranks compiled for 25 s).
PER_GENERATION = frozenset({
    "MS_SCHED_HOST", "MS_SCHED_PORT", GENERATION_ENV, RESUME_FROM_ENV, RESUME_STEP_ENV,
    RESUME_MEMORY_STEP_ENV, RESUME_SAMPLES_ENV, "RANK_TABLE_FILE", CONTROL_FILE_ENV,
    SKIPS_FILE_ENV,
})
CACHE_VARIABLES = ("MS_COMPILER_CACHE_ENABLE", "MS_COMPILER_CACHE_PATH")
KEPT_CACHES = 64

log = logging.getLogger(__name__)


def cache_key(argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> str:
    kept = {k: v for k, v in env.items() if k not in PER_GENERATION}
    text = json.dumps({"argv": list(argv), "cwd": str(cwd), "env": kept}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class CompileCacheLauncher:
    """A `ProcessLauncher` that starts every process through `inner` with the compile cache on, in
    `root / cache_key(...)` (created for `user`, who runs the processes)."""

    def __init__(self, inner: ProcessLauncher, root: Path, user: WorkerUser | None = None) -> None:
        self._inner = inner
        self._root = root
        self._user = user

    async def prepare(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> None:
        await self._inner.prepare(argv, env, cwd)  # the cache's variables are not read at import

    async def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path) -> ProcessHandle:
        if not any(name in env for name in CACHE_VARIABLES):
            directory = self._root / cache_key(argv, env, cwd)
            self._make(directory)
            await asyncio.to_thread(remove_least_recently_used, self._root, KEPT_CACHES)
            env = {**env, "MS_COMPILER_CACHE_ENABLE": "1", "MS_COMPILER_CACHE_PATH": str(directory)}
        return await self._inner.start(argv, env, cwd, log_path)

    def _make(self, directory: Path) -> None:
        for path in (self._root, directory):
            path.mkdir(mode=0o700, exist_ok=True)
            if self._user is not None:
                os.chown(path, self._user.uid, self._user.gid)
        os.utime(directory)  # used now: the last to go


def remove_least_recently_used(root: Path, keep: int) -> list[Path]:
    """Remove all but the `keep` most recently used cache directories under `root` (by modification
    time, which every start sets); returns what was removed. Symbolic links and files are left alone."""
    try:
        entries = [e for e in root.iterdir() if not e.is_symlink() and e.is_dir()]
    except FileNotFoundError:
        return []
    entries.sort(key=lambda e: e.stat().st_mtime_ns, reverse=True)
    removed = []
    for entry in entries[keep:]:
        try:
            shutil.rmtree(entry)
        except OSError as exc:
            log.warning("could not remove the compile cache %s: %s", entry, exc)
            continue
        removed.append(entry)
    return removed
