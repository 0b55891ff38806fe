"""Whose checkpoints a checkpoint directory holds: one job's only.

Step directories are named by step alone (`step_00000450`), and retention keeps the newest `keep` of
whatever it finds. Two jobs given one `checkpoint.dir` (a job renamed to start afresh, its directory
left as it was) would overwrite each other's steps, and each save would prune the other job's newest
checkpoints. So the first job to save into a directory claims it, in a file naming the job, and any other
job is refused it with one line before it trains a step.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from common.atomic_write import fsync_dir
from trainer.checkpoint.errors import CheckpointError

OWNER_FILE = "trainerd-job"
_MAX_OWNER_BYTES = 1024
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class DirectoryOfAnotherJob(CheckpointError):
    """The checkpoint directory holds another job's checkpoints (or cannot say whose it holds)."""


def claim_for_job(root: Path, job: str) -> None:
    """Make `root` the checkpoint directory of `job` (created when missing), or refuse it with
    DirectoryOfAnotherJob when another job claimed it first. A directory of checkpoints saved before
    directories were claimed goes to the first job that saves into it. Safe when every rank of a
    generation claims at once: the owner file appears whole (a hard link to a written temporary file)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / OWNER_FILE
    if not os.path.lexists(path):
        _create(path, job)
    owner = _read_owner(path)
    if owner != job:
        raise DirectoryOfAnotherJob(
            f"checkpoint directory {root} holds the checkpoints of job {owner!r:.80} (its {OWNER_FILE} file): give "
            f"job {job!r} a checkpoint.dir of its own, or leave it unset (run/checkpoints/<job>)")


def _create(path: Path, job: str) -> None:
    """Write the owner file unless another rank got there first: link a written temporary file into place."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{OWNER_FILE}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(job + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return
        fsync_dir(path.parent)
    finally:
        os.unlink(tmp)


def _read_owner(path: Path) -> str:
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        raise DirectoryOfAnotherJob(f"cannot read {path}, which names the job whose checkpoints "
                                    f"{path.parent} holds: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise DirectoryOfAnotherJob(f"{path}, which names the job whose checkpoints {path.parent} holds, is "
                                        f"not a regular file")
        data = os.read(fd, _MAX_OWNER_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_OWNER_BYTES:
        raise DirectoryOfAnotherJob(f"{path} is over {_MAX_OWNER_BYTES} bytes: it is not a job's name")
    return data.decode("utf-8", errors="replace").strip()
