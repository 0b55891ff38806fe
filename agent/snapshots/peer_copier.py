"""The ring copier: this agent keeps a copy of another node's newest pinned snapshot, so that a relaunch
after that node is lost still finds its ranks on a host that survived (agent/snapshots/memory_snapshots.py).

A thread of its own asks the source (`PeerClient`, blocking calls) for a snapshot newer than the last it
copied, a long poll the source answers as soon as one is pinned there, and streams each rank's files to disk
under `copies_root(job)/<node>/step_N.partial/`, renamed `step_N` once every rank is there, so `held` and
`assemble` see only whole copies. Two steps are kept per source: the newest, and the one before while a
relaunch may still name it. A source that is down, or that answers at once with nothing new (an agent from
before the long poll), is asked again `interval_s` after the last call began.

What a source lists is bounded before anything is fetched: each rank once and inside its world size, and
no more ranks than the generation's world size (one host holds fewer). No copy takes the memory file
system past `COPIES_FILL_AT_MOST` full (agent/snapshots/memory_snapshots.py). The copier owns its client: `stop`
closes it, which ends a fetch under way at once rather than when its timeout runs out.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path

from agent.commands import PeerAgent
from agent.snapshots.memory_snapshots import (
    PARTIAL,
    MemorySnapshotDir,
    is_real_dir,
    real_children,
    remove_entry,
    step_dir_name,
    step_dirs,
)
from agent.snapshots.peer_client import PeerClient
from agent.thread_priority import lower_this_threads_priority
from proto import trainerd_pb2 as pb
from proto.vocabulary import NODE_NAME_PATTERN

log = logging.getLogger(__name__)

KEPT_STEPS = 2
# The least time between two ListSnapshots calls to a source that answers at once. With the long poll a new
# snapshot is copied as soon as its source pins it (within the source's LIST_LOOK_INTERVAL_S); polled at
# 1 s, hosts that died soon after a snapshot often left it without its peer copy (in
# tests/integration/test_peer_snapshots.py, two dead neighbours took two ranks of the newest snapshot with
# them, not one), so the coordinator fell back further. Polled every 0.1 s, an idle copier made ten calls a
# second, each reading every report at its source.
POLL_INTERVAL_S = 0.1
LIST_WAIT_S = 2.0  # how long the source may hold a ListSnapshots with nothing new
LIST_TIMEOUT_S = 5.0  # for the answer, beyond LIST_WAIT_S
FETCH_TIMEOUT_S = 600.0  # one rank's file, gigabytes over the cluster's network
STOP_TIMEOUT_S = 5.0


class PeerCopier:
    """Copies `source`'s newest snapshot of `job` into `memory`, every `interval_s` while started, through
    `client`, which it closes when it stops; `max_ranks`: the generation's world size."""

    def __init__(self, memory: MemorySnapshotDir, client: PeerClient, job: str, source: PeerAgent,
                 max_ranks: int, interval_s: float = POLL_INTERVAL_S) -> None:
        if not re.fullmatch(NODE_NAME_PATTERN, source.node):
            raise ValueError(f"node name {source.node!r:.80} cannot name a directory of copies")
        self._memory = memory
        self._client = client
        self._job = job
        self._source = source
        self._max_ranks = max_ranks
        self._interval_s = interval_s
        self._directory = memory.copies_root(job) / source.node
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self._newest_listed = -1  # the newest step copied: the next call waits for a newer one

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"copier-{self._source.node}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop polling and end the fetch under way; its partial copy is removed."""
        self._stopping.set()
        self._client.close()
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_S)
            self._thread = None

    def _run(self) -> None:
        lower_this_threads_priority()
        began = time.monotonic()
        while not self._stopping.wait(max(0.0, began + self._interval_s - time.monotonic())):
            began = time.monotonic()
            try:
                self._copy_newest()
            except Exception as exc:  # noqa: BLE001 - the copier outlives every error: the next poll retries
                if self._stopping.is_set():
                    return  # the fetch it ended
                log.log(logging.DEBUG if self._failing else logging.WARNING,
                        "cannot copy the snapshots of node %s (%s): %s", self._source.node, self._source.address,
                        str(exc).replace("\n", " ") or type(exc).__name__)
                self._failing = True
            else:
                self._failing = False

    def _copy_newest(self) -> None:
        listed = self._client.list_snapshots(self._source, self._job, LIST_TIMEOUT_S,
                                             newer_than_step=self._newest_listed, wait_s=LIST_WAIT_S)
        snapshots = [s for s in listed if s.step >= 0]
        if not snapshots:
            return
        newest = max(snapshots, key=lambda s: s.step)
        target = self._directory / step_dir_name(newest.step)
        if is_real_dir(target):
            self._newest_listed = newest.step
            return
        problem = _implausible(newest, self._max_ranks)
        if problem:
            raise ValueError(f"its snapshot of step {newest.step} {problem}; not copied")
        self._make_dir(self._memory.copies_root(self._job))
        self._make_dir(self._directory)
        partial = target.with_name(target.name + PARTIAL)
        remove_entry(partial)
        self._make_dir(partial)
        try:
            for rank in newest.ranks:
                if self._stopping.is_set():
                    raise InterruptedError("stopped")
                self._client.fetch_rank(self._source, self._job, newest.step, rank, partial, FETCH_TIMEOUT_S,
                                        max_data_bytes=self._memory.room_for_copies())
        except BaseException:
            remove_entry(partial)  # what a copy holds is memory the host needs back
            raise
        partial.rename(target)
        self._newest_listed = newest.step
        log.debug("copied the snapshot of step %d of node %s (ranks %s)", newest.step, self._source.node,
                 list(newest.ranks))
        self._prune()

    def _make_dir(self, path: Path) -> None:
        """A real directory at `path`: a link or file there is removed first."""
        if not is_real_dir(path):
            remove_entry(path)
        self._memory.make_dir(path)

    def _prune(self) -> None:
        """Keep the KEPT_STEPS newest copies; remove the older ones and anything else."""
        steps = sorted(step_dirs(self._directory), key=lambda child: int(child.name[5:]), reverse=True)
        kept = set(steps[:KEPT_STEPS])
        for child in real_children(self._directory):
            if child not in kept:
                remove_entry(child)


def _implausible(snapshot: pb.MemorySnapshot, max_ranks: int) -> str:
    """Why a listed snapshot cannot be one node's share ('' when it can be)."""
    ranks = list(snapshot.ranks)
    if len(set(ranks)) != len(ranks):
        return "names a rank twice"
    if any(not 0 <= rank < snapshot.world_size for rank in ranks):
        return f"names ranks outside its world size {snapshot.world_size}"
    if len(ranks) > max_ranks:
        return f"names {len(ranks)} ranks, more than the {max_ranks} of this generation's world"
    return ""
