"""Where a generation's files live on this host, and how many generations are kept.

Each generation the agent launches gets `<work_dir>/generations/<generation:06d>/`: its rank table, skip
list and control file, every process's log (read back by `trainerctl logs`), and a `job` file naming the
job. Generation numbers are per job, so a job given a new name starts again at 1 on hosts that ran the
old one: a directory left by another job is emptied before it is used. A week-long job can go
through thousands of generations, so only the newest `KEPT_GENERATIONS` directories stay; older ones are
removed when a new generation starts. Nothing but numbered directories is touched, and rmtree does not
follow symbolic links.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

KEPT_GENERATIONS = 32
JOB_FILE = "job"

log = logging.getLogger(__name__)


def generations_root(agent_work_dir: Path) -> Path:
    return agent_work_dir / "generations"


def generation_dir(agent_work_dir: Path, generation: int) -> Path:
    return generations_root(agent_work_dir) / f"{generation:06d}"


def claim_generation_dir(agent_work_dir: Path, generation: int, job: str) -> Path:
    """The directory of `job`'s `generation`, created; emptied first when another job's generation of the
    same number left it (its logs must not run into this job's). One without a `job` file, made by an agent
    from before the file existed, is taken as this job's."""
    path = generation_dir(agent_work_dir, generation)
    marker = path / JOB_FILE
    try:
        owner = marker.read_text()
    except OSError:  # none (a new directory, or an older agent's), or unreadable: left as it is
        owner = job
    if owner != job:
        log.info("generation %d: removing the files job %r left in %s", generation, owner[:200], path)
        try:
            shutil.rmtree(path)
        except OSError as exc:  # the launch goes on; its logs follow the other job's
            log.warning("could not remove the files of generation %d (%s): %s", generation, path, exc)
    path.mkdir(parents=True, exist_ok=True)
    marker.write_text(job)
    return path


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
