"""The embedded etcd is supervised: trainerd restarts it when it dies, and exits when it cannot.

The etcd trainerd runs itself (no endpoints in the cluster file) is the only durable truth: when it
dies, trainerd restarts it on the same ports with the same data directory, and the coordinator,
which stood down while etcd was gone, campaigns again. When the restart fails, or etcd dies
`max_deaths` times within `window_s`, a restart loop would hide a real fault: trainerd exits
non-zero with one line, so that systemd restarts it (and an operator reads why).
"""

from __future__ import annotations

import collections
import logging
from typing import NoReturn

from common.clock import Clock
from daemon.etcd_process import EmbeddedEtcd, EtcdStartError

log = logging.getLogger(__name__)

MAX_DEATHS = 3
WINDOW_S = 60.0


class EtcdKeepsDying(EtcdStartError):
    """The embedded etcd died too often to be restarted again: read its log (etcd.log in its data
    directory), fix the cause, then start trainerd again (systemd does)."""


def describe_exit(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


class EtcdSupervisor:
    def __init__(self, etcd: EmbeddedEtcd, clock: Clock, max_deaths: int = MAX_DEATHS,
                 window_s: float = WINDOW_S) -> None:
        self._etcd = etcd
        self._clock = clock
        self._max_deaths = max_deaths
        self._window_s = window_s

    async def run(self) -> NoReturn:
        """Restart etcd each time it dies; runs until cancelled.

        Raises:
            EtcdStartError: a restart failed (the message has etcd's last word).
            EtcdKeepsDying: etcd died `max_deaths` times within `window_s`.
        """
        deaths: collections.deque[float] = collections.deque()
        while True:
            code = await self._etcd.wait_exited()
            now = self._clock.now()
            deaths.append(now)
            while deaths[0] < now - self._window_s:
                deaths.popleft()
            if len(deaths) >= self._max_deaths:
                raise EtcdKeepsDying(
                    f"the embedded etcd at {self._etcd.endpoint} died {len(deaths)} times within "
                    f"{self._window_s:.0f}s (the last time it {describe_exit(code)}); not restarting it again "
                    f"(log: {self._etcd.log_path})")
            log.error("the embedded etcd at %s %s; restarting it with the same data (%d death(s) within %.0fs)",
                      self._etcd.endpoint, describe_exit(code), len(deaths), self._window_s)
            await self._etcd.start()
