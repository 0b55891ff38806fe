"""Follows what one process appends to its log file and turns it into progress observations.

The supervisor polls each running worker's follower every half second; each poll reads only the
bytes written since the last one, at most MAX_READ_BYTES, so a rank that floods its log delays its
own progress reports and nothing else. When the process exits, `finish` reads what is left (up to
MAX_FINISH_BYTES) and flushes a last line that ended without a newline.
"""

from __future__ import annotations

import re
from pathlib import Path

from agent.output_progress import EpochShape, OutputProgress, OutputProgressParser

MAX_READ_BYTES = 1 << 20
MAX_FINISH_BYTES = 8 << 20


class OutputFollower:
    def __init__(self, log_path: Path, progress_pattern: re.Pattern[str] | None = None,
                 shape: EpochShape | None = None) -> None:
        """Starts at the log's current end: only what is appended from now on is read."""
        self._path = log_path
        self._parser = OutputProgressParser(progress_pattern, shape)
        try:
            self.offset = log_path.stat().st_size
        except OSError:
            self.offset = 0

    def read(self, limit: int = MAX_READ_BYTES) -> list[OutputProgress]:
        """What the bytes appended since the last read (at most `limit`) say."""
        try:
            with open(self._path, "rb") as log_file:
                log_file.seek(self.offset)
                data = log_file.read(limit)
        except OSError:
            return []
        self.offset += len(data)
        return self._parser.feed(data)

    @property
    def epoch_shape(self) -> EpochShape | None:
        return self._parser.epoch_shape

    def finish(self) -> list[OutputProgress]:
        """What the rest of the log says, the last unterminated line included (the process has exited)."""
        observations: list[OutputProgress] = []
        for _ in range(MAX_FINISH_BYTES // MAX_READ_BYTES):
            before = self.offset
            observations += self.read()
            if self.offset - before < MAX_READ_BYTES:
                break
        return observations + self._parser.close()
