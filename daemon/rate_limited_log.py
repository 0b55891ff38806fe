"""Warnings about what peers send, at most one a minute per peer: a broken or hostile agent that
repeats a bad message cannot flood the coordinator's log. The next warning says how many were held back."""

from __future__ import annotations

import logging

from common.clock import Clock, SystemClock

INTERVAL_S = 60.0
# Past this many peers the memory of who was warned when starts over (it must not grow without bound).
MAX_KEYS = 10000


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, clock: Clock | None = None, interval_s: float = INTERVAL_S) -> None:
        self._log = logger
        self._clock = clock or SystemClock()
        self._interval_s = interval_s
        self._last: dict[str, tuple[float, int]] = {}  # key -> (when last logged, how many held back since)

    def warning(self, key: str, message: str, *args: object, **kwargs) -> None:
        self._emit(logging.WARNING, key, message, args, kwargs)

    def error(self, key: str, message: str, *args: object, **kwargs) -> None:
        self._emit(logging.ERROR, key, message, args, kwargs)

    def _emit(self, level: int, key: str, message: str, args: tuple, kwargs: dict) -> None:
        now = self._clock.now()
        last = self._last.get(key)
        if last is not None and now - last[0] < self._interval_s:
            self._last[key] = (last[0], last[1] + 1)
            return
        if len(self._last) >= MAX_KEYS:
            self._last.clear()
        self._last[key] = (now, 0)
        held_back = 0 if last is None else last[1]
        if held_back:
            message += f" ({held_back} more about {key} held back since the last)"
        self._log.log(level, message, *args, **kwargs)
