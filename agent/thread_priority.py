"""The agent's background copies yield the cores to training.

The persister's copies of checkpoints (agent/snapshots/checkpoint_persister.py), the ring copier's fetches of
peers' snapshots (agent/snapshots/peer_copier.py) and the SnapshotPeer server's streams
(agent/snapshots/peer_service.py) run beside the workers on the same cores; training must not wait for them.
Their threads therefore run at the lowest CPU priority. On Linux the nice value is a thread's own (see
setpriority(2), "BUGS"), so this leaves the agent's event loop, and its heartbeats, at their priority.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

BACKGROUND_NICENESS = 19


def lower_this_threads_priority() -> None:
    """Give the calling thread the lowest CPU priority (logged, not raised, where it cannot be done)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)
    except OSError as exc:
        log.debug("cannot lower the priority of thread %s: %s", threading.current_thread().name, exc)
