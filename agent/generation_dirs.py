"""Where a generation's files live on this host, and how many generations are kept.

Each generation the agent launches gets `<work_dir>/generations/<generation:06d>/`: its rank table, skip
list and control file, and every process's log (read back by `trainerctl logs`). A week-long job can go
through thousands of generations, so only the newest `KEPT_GENERATIONS` directories stay; older ones are
removed when a new generation starts. Nothing but numbered directories is touched, and rmtree does not
follow symbolic links.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

KEPT_GENERATIONS = 32

log = logging.getLogger(__name__)


def generations_root(agent_work_dir: Path) -> Path:
    return agent_work_dir / "generations"


def generation_dir(agent_work_dir: Path, generation: int) -> Path:
    return generations_root(agent_work_dir) / f"{generation:06d}"


def prune_generation_dirs(agent_work_dir: Path, current: int, keep: int = KEPT_GENERATIONS) -> list[int]:
    """Remove the directories of all but the newest `keep` generations up to `current` (never `current`
    itself, nor a newer one, nor anything not named like a generation); returns the generations removed."""
    try:
        entries = list(generations_root(agent_work_dir).iterdir())
    except FileNotFoundError:
        return []
    numbered = sorted((int(entry.name), entry) for entry in entries
                      if entry.name.isdigit() and len(entry.name) >= 6 and not entry.is_symlink()
                      and entry.is_dir() and int(entry.name) <= current)
    removed = []
    for generation, entry in numbered[:max(0, len(numbered) - max(keep, 1))]:
        if generation == current:
            continue
        try:
            shutil.rmtree(entry)
        except OSError as exc:
            log.warning("could not remove the files of generation %d (%s): %s", generation, entry, exc)
            continue
        removed.append(generation)
    return removed
