"""A coordinator pass that fails with a bug is logged and tried again later; it never ends the process.

Store errors and a lost leadership are not bugs: they pass through to the caller, which stands down
and campaigns again. Anything else a pass raises (one bad report, one unforeseen value) is logged
with its cause and traceback, and the pass is skipped until a backoff has passed: doubling per
consecutive failure, capped, so a lasting fault neither floods the log nor stops retrying.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from common.clock import Clock
from daemon import metrics
from daemon.store.interface import LeadershipLost, StoreError

log = logging.getLogger(__name__)

FIRST_RETRY_S = 1.0
MAX_RETRY_S = 30.0


class PassGuard:
    def __init__(self, what: str, clock: Clock, first_retry_s: float = FIRST_RETRY_S,
                 max_retry_s: float = MAX_RETRY_S) -> None:
        self._what = what
        metrics.PASS_FAILURES.labels(what)  # at 0 from the start: a rule sees the first failure as an increase
        self._clock = clock
        self._first_retry_s = first_retry_s
        self._max_retry_s = max_retry_s
        self._failures = 0
        self._retry_at: float | None = None

    @property
    def failures(self) -> int:
        """Consecutive failures of the pass (0 once it succeeded)."""
        return self._failures

    async def run(self, one_pass: Callable[[], Awaitable[None]]) -> None:
        """Run `one_pass` unless it is backing off after a failure.

        Raises:
            LeadershipLost, StoreError: as `one_pass` raised them.
        """
        now = self._clock.now()
        if self._retry_at is not None and now < self._retry_at:
            return
        try:
            await one_pass()
        except (StoreError, LeadershipLost):
            raise
        except Exception as exc:  # noqa: BLE001 - one bad pass must not end the coordinator
            self._failures += 1
            delay = min(self._first_retry_s * 2 ** (self._failures - 1), self._max_retry_s)
            self._retry_at = now + delay
            metrics.PASS_FAILURES.labels(self._what).inc()
            log.error("%s failed (%s: %s); trying again in %.0fs (%d failure(s) in a row)", self._what,
                      type(exc).__name__, exc, delay, self._failures, exc_info=exc)
        else:
            self._failures = 0
            self._retry_at = None
