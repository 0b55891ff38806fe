"""job.node_check: a host returning from LOST or a quarantine runs it before it is offered work.

The leader sends the node a NodeCheck when its session opens after it was LOST, or when an operator
undrains it while it is quarantined (undrain lifts the quarantine) or after it failed a check; until
the agent answers that check, and after it failed, the node takes no part in a generation. A failure
keeps it out, with the reason in the events, until it comes back again or is undrained. Pending
checks live in the leader's memory only: a new leader offers a connected READY node without checking it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeCheckCommand:
    check_id: int
    argv: tuple[str, ...]
    timeout_s: float


class NodeChecks:
    def __init__(self, argv: Sequence[str] | None, timeout_s: float) -> None:
        self._argv = tuple(argv or ())
        self._timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._pending: dict[str, int] = {}
        self.failed: dict[str, str] = {}

    def start(self, node: str) -> NodeCheckCommand | None:
        """A new check of `node` (replacing any earlier one); None when the job names no node_check."""
        if not self._argv:
            return None
        check_id = next(self._ids)
        self._pending[node] = check_id
        self.failed.pop(node, None)
        return NodeCheckCommand(check_id, self._argv, self._timeout_s)

    def result(self, node: str, check_id: int, passed: bool, detail: str) -> bool | None:
        """Record the answer; None when it answers no check still pending (an old or forged one)."""
        if self._pending.get(node) != check_id:
            return None
        del self._pending[node]
        if not passed:
            self.failed[node] = detail
        return passed

    def forget(self, node: str) -> None:
        """The node left the cluster's records: nothing of it is kept."""
        self._pending.pop(node, None)
        self.failed.pop(node, None)

    def excluded(self) -> set[str]:
        """Nodes not to offer: waiting for their check, or failed it."""
        return set(self._pending) | set(self.failed)
