"""When a worker saves a checkpoint: after every N-th step, and at the step the coordinator asks for.

Pure (no MindSpore). The coordinator asks through the agent, which (re)writes the control file
atomically (its format is `proto.worker_files`). Every rank reads the same file and takes the same
decision: a request of its own generation for a step it has not completed yet is honoured after that
step; one for a step it has already completed is ignored with a warning (so the coordinator must ask
far enough ahead that no rank has passed the step when the file reaches it); one of another
generation is ignored. The file is checked once per step with one `os.stat` and read only when it
changed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from proto.worker_files import MAX_CONTROL_BYTES, ControlFileRequest, MalformedControlFile, decode_control

log = logging.getLogger(__name__)

_STAT_FAILED = (-1, -1, -1)


class ControlFile:
    """The agent's control file, polled cheaply: one stat per call, a read only when it changed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._signature: tuple[int, int, int] | None = None
        self._last: ControlFileRequest | None = None

    def poll(self) -> ControlFileRequest | None:
        """The request in the file when it differs from the last one returned, else None.

        A missing file holds no request; an unreadable or malformed one is logged and skipped until it
        changes again.
        """
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._skip(_STAT_FAILED, f"cannot be examined: {exc.strerror}")
            return None
        # The agent renames a new file into place, so the inode changes even within one mtime tick.
        signature = (st.st_ino, st.st_mtime_ns, st.st_size)
        if signature == self._signature:
            return None
        if st.st_size > MAX_CONTROL_BYTES:
            self._skip(signature, f"is {st.st_size} bytes, more than {MAX_CONTROL_BYTES}")
            return None
        try:
            with open(self.path, "rb") as f:
                request = decode_control(f.read(MAX_CONTROL_BYTES + 1))
        except FileNotFoundError:  # replaced between stat and open: the next poll sees the new one
            return None
        except OSError as exc:
            self._skip(signature, f"cannot be read: {exc.strerror}")
            return None
        except MalformedControlFile as exc:
            self._skip(signature, str(exc))
            return None
        self._signature = signature
        if request == self._last:  # rewritten with the same request (an agent that restarted)
            return None
        self._last = request
        return request

    def _skip(self, signature: tuple[int, int, int], problem: str) -> None:
        """Warn once per version of the file (or per run of failed stats) and remember it as seen."""
        if signature != self._signature:
            log.warning("Ignoring the control file %s: it %s.", self.path, problem)
        self._signature = signature


class CheckpointSchedule:
    """Decides, after each completed step, whether this rank saves a checkpoint now.

    `every` > 0 saves after every step that is a multiple of it (global step numbers, so a resumed
    job keeps the same rhythm); the control file, when there is one, adds single requested steps.
    """

    def __init__(self, every: int, generation: int, control: ControlFile | None, where: str) -> None:
        if every < 0:
            raise ValueError(f"checkpoint interval must be at least 0, got {every}")
        self._every = every
        self._generation = generation
        self._control = control
        self._where = where
        self.requested: int | None = None  # the pending requested step, None when there is none

    def due(self, completed: int) -> bool:
        """Whether to save now, step `completed` having just completed."""
        request = self._control.poll() if self._control is not None else None
        if request is not None:
            self._consider(request, completed)
        if self.requested == completed:
            self.requested = None
            return True
        return self._every > 0 and completed % self._every == 0

    def _consider(self, request: ControlFileRequest, completed: int) -> None:
        if request.generation != self._generation:
            log.info("%s: ignoring a checkpoint request of generation %d for step %d.",
                     self._where, request.generation, request.step)
        elif request.step <= completed:
            log.warning("%s: the checkpoint requested at step %d arrived after step %d had completed; ignored.",
                        self._where, request.step, completed)
        else:
            if self.requested is not None:
                log.info("%s: the checkpoint request for step %d replaces the one for step %d.",
                         self._where, request.step, self.requested)
            self.requested = request.step
