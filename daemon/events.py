"""The job's event log in etcd (`jobs/{job}/events/{seq}`): what happened, when, and why.

The log is bounded: the leader's periodic pass deletes the oldest events beyond the newest `keep`
and those older than `max_age_s` (never the newest, so sequence numbers never start over). Nothing
reads the whole prefix: events are read a page at a time, and the next sequence number comes from
the newest key alone. Keys are zero-padded, so they sort as the numbers do.

Events about nodes (NODE_EVENT_KINDS: joined, ready, lost, drained, checked) are kept under their own
prefix (`jobs/{job}/node_events/{seq}`), numbered with the others and read merged with them, and bounded
apart: each kind of history keeps its newest `keep`. A node comes and goes as often as its agent dials, and
one certificate's 150 Hello/close cycles, each with a new host, left no job event after the next compaction
(issue 47): the newest job events now survive any amount of node churn.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass, field

from common.clock import Clock
from daemon.store import codec, keys
from daemon.store.interface import Fence, Store, ensure_fence, prefix_end

log = logging.getLogger(__name__)

# The most events one read returns (each is at most a few KiB: far below gRPC's 4 MiB messages).
EVENTS_PAGE = 500
# Compaction deletes at most this many pages per pass (of each kind of history); the next pass goes on.
COMPACTION_PAGES_PER_PASS = 20


class EventKind(enum.StrEnum):
    """Every kind of event the coordinator appends: one list, which docs/reference/events.md is generated
    from and tests/test_docs_reference.py checks against every kind the code appends. The comment above a
    kind is its documentation."""

    # A coordinator took the lead (a failover, or trainerd started again); names it and its address.
    COORDINATOR_LEADS = "coordinator_leads"
    # A node registered for the first time.
    NODE_JOINED = "node_joined"
    # A known node is READY again (it came back from LOST, or with other devices).
    NODE_READY = "node_ready"
    # A node is LOST: its session broke and it did not return within the grace, or it went silent.
    NODE_LOST = "node_lost"
    # A node LOST for longer than cluster.heartbeat.forget_lost_after_s left the node records.
    NODE_FORGOTTEN = "node_forgotten"
    # An operator drained a node (trainerctl nodes drain): a running job lets it go at a checkpoint.
    NODE_DRAINED = "node_drained"
    # An operator put a node back in service (trainerctl nodes undrain), lifting a quarantine.
    NODE_UNDRAINED = "node_undrained"
    # A node back from LOST or from a quarantine runs job.node_check before it is offered work.
    NODE_CHECK_STARTED = "node_check_started"
    # It passed (exit 0): the node is offered work again.
    NODE_CHECK_PASSED = "node_check_passed"
    # It failed or timed out: the node stays out until it returns again or is undrained; the reason is given.
    NODE_CHECK_FAILED = "node_check_failed"
    # The job in the cluster file differs from the one in etcd; names what changed.
    JOB_CHANGED = "job_changed"
    # A generation was launched: its nodes, world size, gradient accumulation and where it resumes from.
    GENERATION_STARTED = "generation_started"
    # Every rank of the generation reported a step: the job is RUNNING (after a recovery: its phases).
    JOB_RUNNING = "job_running"
    # Fewer usable devices than the job needs: it waits for nodes; says what it waits for.
    JOB_WAITING = "job_waiting"
    # A generation failed and the job recovers: the cause, the root cause, a quarantine if one began.
    RECOVERY_STARTED = "recovery_started"
    # The world changes size (a node joined, was drained or undrained) at a checkpoint.
    RESHAPE_STARTED = "reshape_started"
    # Every rank finished: the job is COMPLETED.
    JOB_COMPLETED = "job_completed"
    # The job is FAILED: the cause (restart budget spent, a job error, bad data, a usage error, ...).
    JOB_FAILED = "job_failed"
    # An operator asked to pause (trainerctl pause): the generation saves first.
    PAUSE_REQUESTED = "pause_requested"
    # trainerctl resume came before the job was PAUSED: the pause is called off.
    PAUSE_CANCELLED = "pause_cancelled"
    # The job is PAUSED.
    JOB_PAUSED = "job_paused"
    # An operator resumed a PAUSED or FAILED job (trainerctl resume), its restart budget refilled.
    JOB_RESUMED = "job_resumed"
    # The coordinator asked the generation for a checkpoint at a step ahead (growth, drain, pause, stop).
    CHECKPOINT_REQUESTED = "checkpoint_requested"
    # A script with job.graceful_exit_file is asked to leave through its graceful exit.
    EXIT_REQUESTED = "exit_requested"
    # A checkpoint was committed and entered the catalog.
    CHECKPOINT_SAVED = "checkpoint_saved"
    # A save failed (a full disk, an unwritable directory): the rank, the reason, the last good checkpoint.
    CHECKPOINT_FAILED = "checkpoint_failed"
    # Samples entered the skip ledger: a bad batch, a step that crashed repeatedly, or trainerctl skips add.
    SAMPLES_SKIPPED = "samples_skipped"
    # A rank's replay of a step its guard refused came out otherwise: its device computed wrong. The step was
    # taken from the replay, and no samples were skipped.
    DEVICE_SUSPECTED = "device_suspected"
    # More reproduced spikes than bad data makes in a window: the guard learns its statistics afresh.
    GUARD_REBASELINED = "guard_rebaselined"
    # The worker runtime found something risky about the job at its start (it may work): what and why.
    JOB_WARNING = "job_warning"
    # A node's agent refused a generation's Launch (a forbidden variable, a disallowed entrypoint): its reason.
    LAUNCH_REFUSED = "launch_refused"
    # The in-memory snapshot a generation was to resume from could not be assembled or verified: the relaunch
    # falls back to the next newest source.
    SNAPSHOT_UNUSABLE = "snapshot_unusable"


# The events about a node rather than the job, kept and bounded apart from the job's.
NODE_EVENT_KINDS = frozenset({
    EventKind.NODE_JOINED, EventKind.NODE_READY, EventKind.NODE_LOST, EventKind.NODE_FORGOTTEN,
    EventKind.NODE_DRAINED, EventKind.NODE_UNDRAINED, EventKind.NODE_CHECK_STARTED, EventKind.NODE_CHECK_PASSED,
    EventKind.NODE_CHECK_FAILED,
})


@dataclass(frozen=True)
class Event:
    seq: int
    at: float  # wall-clock seconds
    kind: str  # an EventKind's value: node_joined, node_lost, generation_started, ...
    message: str
    fields: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"seq": self.seq, "at": self.at, "kind": self.kind, "message": self.message,
                "fields": self.fields}

    @classmethod
    def from_json(cls, data: dict) -> "Event":
        return cls(int(data["seq"]), float(data["at"]), str(data["kind"]), str(data["message"]),
                   dict(data.get("fields", {})))


def _seq_of(key: str) -> int:
    return int(key.rsplit("/", 1)[1])


def _ordinal_of(key: str, value: bytes) -> int:
    """An event's place among its prefix's events. An event written before node events were kept apart has
    none: they were all numbered in one run then, so its sequence number is its place (and an unreadable
    one's, which the count bounds)."""
    try:
        return int(codec.decode(value, key=key).get("ordinal", _seq_of(key)))
    except (codec.BadValue, AttributeError, TypeError, ValueError):
        return _seq_of(key)


class EventLog:
    """Appends events with increasing sequence numbers; only the leader appends (fenced)."""

    def __init__(self, store: Store, job_name: str, clock: Clock) -> None:
        self._store = store
        self._job = job_name
        self._clock = clock
        self._prefixes = (keys.events(job_name), keys.node_events(job_name))  # the job's, the nodes'
        self._next_seq: int | None = None
        # Per prefix, the next event's ordinal: its place among that prefix's events, stored with it, by which
        # compaction counts what it keeps of each (the sequence numbers of either have gaps: the other's).
        self._next_ordinal: dict[str, int] = {}
        self._load_lock = asyncio.Lock()

    async def _newest(self, prefix: str) -> tuple[int, int]:
        """The sequence number and ordinal of the newest event under `prefix` ((0, 0): none), from its key alone."""
        kvs, _ = await self._store.get_range(prefix, prefix_end(prefix), limit=1, descending=True)
        return (_seq_of(kvs[0].key), _ordinal_of(kvs[0].key, kvs[0].value)) if kvs else (0, 0)

    def _prefix(self, kind: EventKind) -> str:
        return self._prefixes[1] if kind in NODE_EVENT_KINDS else self._prefixes[0]

    async def append(self, kind: EventKind, message: str, fence: Fence, **fields) -> Event:
        """Sequence numbers are handed out without awaiting, so concurrent appends (thousands of nodes
        joining at once) never race for the same number; a re-read happens only after a conflict."""
        while True:
            if self._next_seq is None:
                async with self._load_lock:
                    if self._next_seq is None:
                        newest = [await self._newest(prefix) for prefix in self._prefixes]
                        self._next_ordinal = {p: ordinal + 1 for p, (_, ordinal) in zip(self._prefixes, newest)}
                        self._next_seq = max(seq for seq, _ in newest) + 1
            prefix = self._prefix(kind)
            event = Event(self._next_seq, self._clock.wall(), kind, message, fields)
            ordinal = self._next_ordinal[prefix]
            self._next_seq += 1
            self._next_ordinal[prefix] += 1
            written = await self._store.compare_and_swap(
                prefix + f"{event.seq:012d}", codec.encode({**event.to_json(), "ordinal": ordinal}), 0, fence=fence
            )
            if written is not None:
                log.info("event %s: %s", kind, message)
                return event
            # A previous leader wrote this sequence number, or our fence broke: re-read.
            await ensure_fence(self._store, fence)
            self._next_seq = None

    async def read(self, after_seq: int = 0, limit: int = EVENTS_PAGE) -> list[Event]:
        """The oldest `limit` (at most EVENTS_PAGE) events with a sequence number above `after_seq`, of both
        kinds (a page of each, merged: the oldest `limit` of the two are among them)."""
        limit = max(1, min(limit, EVENTS_PAGE))
        kvs = []
        for prefix in self._prefixes:
            page, _ = await self._store.get_range(prefix + f"{max(after_seq, 0) + 1:012d}", prefix_end(prefix),
                                                  limit=limit)
            kvs.extend(page)
        kvs.sort(key=lambda kv: _seq_of(kv.key))
        return [Event.from_json(codec.decode(kv.value, key=kv.key)) for kv in kvs[:limit]]

    async def compact(self, keep: int, max_age_s: float, fence: Fence) -> int:
        """Delete the oldest events beyond the newest `keep` of each kind (the job's, the nodes'), and those
        older than `max_age_s`, a page at a time (at most COMPACTION_PAGES_PER_PASS pages of each: the next
        pass goes on). The newest event of each kind always stays. Returns how many were deleted.

        Raises:
            LeadershipLost: another coordinator leads.
            StoreError: etcd failed.
        """
        deleted = 0
        for prefix in self._prefixes:
            deleted += await self._compact(prefix, keep, max_age_s, fence)
        if deleted:
            log.info("job %s: %d old event(s) deleted (keeping at most %d of the job's and %d of its nodes', none "
                     "older than %.0f days)", self._job, deleted, keep, keep, max_age_s / 86400)
        return deleted

    async def _compact(self, prefix: str, keep: int, max_age_s: float, fence: Fence) -> int:
        """`compact` of the events under `prefix`, counted among themselves (by their ordinals)."""
        newest, newest_ordinal = await self._newest(prefix)
        kept_from = newest_ordinal - keep + 1  # by count, every older event goes
        deleted = 0
        for _ in range(COMPACTION_PAGES_PER_PASS):
            kvs, _ = await self._store.get_range(prefix, prefix_end(prefix), limit=EVENTS_PAGE)
            doomed = 0
            for kv in kvs:
                seq = _seq_of(kv.key)
                if seq >= newest:
                    break
                if _ordinal_of(kv.key, kv.value) >= kept_from and not self._older_than(kv.key, kv.value, max_age_s):
                    break
                doomed += 1
            if not doomed:
                break
            count = await self._store.delete_range(kvs[0].key, kvs[doomed - 1].key + "\0", fence=fence)
            if count is None:
                await ensure_fence(self._store, fence)
                break
            deleted += count
            if doomed < len(kvs):
                break
        return deleted

    def _older_than(self, key: str, value: bytes, max_age_s: float) -> bool:
        """False for an event this trainerd cannot read: its age is unknown, the count bounds it."""
        try:
            at = Event.from_json(codec.decode(value, key=key)).at
        except (codec.BadValue, KeyError, TypeError, ValueError):
            return False
        return at < self._clock.wall() - max_age_s
