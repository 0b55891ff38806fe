"""systemd `Type=notify` integration: READY once registered, WATCHDOG pings while healthy."""

from __future__ import annotations

import os

import sdnotify


class SystemdNotifier:
    """No-op outside systemd (no NOTIFY_SOCKET), so the agent runs the same by hand and in tests."""

    def __init__(self) -> None:
        self._enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._notifier = sdnotify.SystemdNotifier() if self._enabled else None
        watchdog_usec = os.environ.get("WATCHDOG_USEC", "")
        self.watchdog_interval_s = int(watchdog_usec) / 2e6 if watchdog_usec.isdigit() else None
        self._ready_sent = False

    def _send(self, state: str) -> None:
        if self._notifier is not None:
            self._notifier.notify(state)

    def ready(self, status: str) -> None:
        if not self._ready_sent:
            self._send("READY=1")
            self._ready_sent = True
        self.status(status)

    def status(self, status: str) -> None:
        self._send(f"STATUS={status}")

    def watchdog(self) -> None:
        self._send("WATCHDOG=1")

    def stopping(self) -> None:
        self._send("STOPPING=1")
