"""The agent's in-memory snapshots (issue 15) and the disk checkpoints it saves from them, as one component.

The rest of the agent (and anything outside it) imports from here, never from a module of this package
(tests/test_import_boundaries.py keeps it so):

- `MemorySnapshotDir`: the shared memory the workers snapshot into (memory_snapshots.py; the per-rank
  reports of a generation spanning hosts: snapshot_reports.py);
- `SnapshotKeeper`, `SnapshotUnavailable`, `HeldReports`: what the supervisor does with a generation's
  snapshots at a Launch, a Stop and in heartbeats (snapshot_keeper.py);
- `PeerServer`, `PeerClient`: the SnapshotPeer service that serves this host's snapshot files to the other
  agents, and its client (peer_service.py, peer_client.py; the ring copier that uses the client:
  peer_copier.py);
- `CheckpointPersister`, `Outbox`: disk checkpoints saved by the agent from the workers' outbox
  (checkpoint_persister.py).
"""

from agent.snapshots.checkpoint_persister import CheckpointPersister, Outbox
from agent.snapshots.memory_snapshots import MemorySnapshotDir
from agent.snapshots.peer_client import PeerClient
from agent.snapshots.peer_service import PeerServer
from agent.snapshots.snapshot_keeper import HeldReports, SnapshotKeeper, SnapshotUnavailable

__all__ = [
    "CheckpointPersister",
    "HeldReports",
    "MemorySnapshotDir",
    "Outbox",
    "PeerClient",
    "PeerServer",
    "SnapshotKeeper",
    "SnapshotUnavailable",
]
