"""The job's goodput accounting across leaders: the accountant (daemon/job/goodput.py) shown the job as it
is, and its totals saved in etcd (`jobs/{job}/goodput`), which the next leader carries on from."""

from __future__ import annotations

import logging
from collections.abc import Callable

from common.clock import Clock
from daemon.job.goodput import GoodputAccountant, GoodputSnapshot, JobMoment, Phase, fault_time
from daemon.job.observation import GenerationObservation
from daemon.job.state import Failure, GenerationRecord, JobRecord
from daemon.store import keys
from daemon.store.fenced_cache import FencedCache
from daemon.store.interface import Fence, Store
from proto.vocabulary import JobState

log = logging.getLogger(__name__)

# The leader saves the goodput totals this often, and whenever the phase changes: a leader that
# dies takes at most this much of the current phase's accounting detail with it (see GoodputAccountant).
GOODPUT_SAVE_INTERVAL_S = 5.0


def job_moment(record: JobRecord, generation: GenerationRecord | None,
               observation: GenerationObservation | None) -> JobMoment:
    """The job as the accountant sees it: its record, and what the leader saw of the current generation."""
    live = generation is not None and observation is not None and not record.between_generations
    progressing = live and observation is not None and (observation.progress_seen
                                                         or record.state is JobState.RUNNING)
    position = observation.newest_position if live and observation is not None else None
    return JobMoment(record.state, record.generation > 0, live, progressing, position)


class GoodputKeeper:
    """`moment()` is the job as it is now (`job_moment` of the controller's record and current generation);
    the keeper shows it to the accountant whenever it may have changed (`account`)."""

    def __init__(self, *, store: Store, job_name: str, clock: Clock, moment: Callable[[], JobMoment]) -> None:
        self._clock = clock
        self._moment = moment
        self._key = keys.job_goodput(job_name)
        self._saved = FencedCache(store, self._key, _saved_goodput)
        self._saved_at: tuple[float, Phase | None] | None = None  # when, and in which phase
        self.accountant = GoodputAccountant(clock)

    async def load(self) -> None:
        """Carry on from the totals the last leader saved (a new job: from nothing)."""
        await self._saved.load()
        self.accountant = GoodputAccountant(self._clock, self._saved.get(self._key))
        self._saved_at = None

    def account(self) -> None:
        """Let the accountant see the job as it is now."""
        self.accountant.observe(self._moment())

    def progressed(self, generation: int, checkpoint_stall_s: float) -> None:
        """A rank of `generation` reported progress, and its step loop's checkpoint stall so far."""
        self.accountant.checkpoint_stall(generation, checkpoint_stall_s)
        self.account()

    def fault_detected(self, failure: Failure, observation: GenerationObservation | None, now: float) -> float:
        """`failure` was just committed: the seconds since its fault go to detection (goodput.fault_time).
        Returns those seconds."""
        return self.accountant.fault_detected(fault_time(failure, observation, now, self.accountant.known_until))

    def lost_work_s(self) -> float:
        """The job's seconds of lost work so far."""
        return self.accountant.snapshot().seconds[Phase.LOST_WORK]

    def snapshot(self) -> GoodputSnapshot:
        return self.accountant.snapshot()

    async def save(self, fence: Fence, at_once: bool = False) -> None:
        """Save the totals every GOODPUT_SAVE_INTERVAL_S and on every change of phase; `at_once`: now."""
        now, phase = self._clock.now(), self.accountant.phase
        saved = self._saved_at
        if not at_once and saved is not None and saved[1] is phase and (
                phase is None or now - saved[0] < GOODPUT_SAVE_INTERVAL_S):
            return
        await self._saved.put(self._key, self.accountant.snapshot(), fence)
        self._saved_at = (now, phase)

    async def stand_down(self, fence: Fence) -> None:
        """This leader stops: the totals are saved as of now, so the next leader accounts exactly the time
        without one, and knows the furthest step reached (lost work when it is trained again)."""
        self.account()
        await self.save(fence, at_once=True)


def _saved_goodput(data: dict) -> GoodputSnapshot:
    """The saved totals; ones this trainerd cannot read are started over (a warning), never a reason
    for a leader not to lead."""
    try:
        return GoodputSnapshot.from_json(data)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        log.warning("the saved goodput totals cannot be read (%s); counting starts over", exc)
        return GoodputSnapshot(phase=None)
