"""Goodput: every second of a job's wall time, accounted to exactly one phase (docs/concepts/goodput.md).

The wall time runs from when the coordinator first took the job on (its submission) to COMPLETED.
Each second goes to the phase the job was in, derived from the leader's own observations:

- waiting: no generation could be placed yet (PENDING before the first launch), or WAITING;
- startup: a generation was launched and none of its ranks reported a step yet;
- productive: a step beyond the job's high-water mark (the furthest position any generation reached);
- lost_work: a step at or below that mark, redone after a restart from an older checkpoint;
- detection: the fault happened -> the coordinator decided it was one. Found after the fact: once a
  failure is committed, the seconds since the fault (the failed process's exit, the lost node's last
  heartbeat, the last step before a hang) move out of the running phase into this one;
- relaunch: the stop was decided -> the next generation was launched (stop, crash backoff, relaunch);
- checkpoint_stall: seconds the workers report their step loop blocked on a checkpoint save, moved out
  of the running phase as the reports arrive;
- paused: PAUSED by the operator, or FAILED until `trainerctl resume`.

Reclassifying (detection, checkpoint stall) only moves seconds between phases, within the current
phase's segment, so the phases always sum to the wall time. The state is bounded: eight totals, the
high-water mark, and the stall already counted for the current generation. `GoodputSnapshot` is what
the leader saves in etcd every few seconds and a new leader carries on from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from common.clock import Clock
from daemon.job.observation import GenerationObservation
from daemon.job.state import Failure, FailureCause
from proto.vocabulary import JobState


class Phase(StrEnum):
    """The value is what etcd, the status JSON (`{phase}_s`) and the metrics' `phase` label carry."""

    PRODUCTIVE = "productive"
    LOST_WORK = "lost_work"
    DETECTION = "detection"
    RELAUNCH = "relaunch"
    STARTUP = "startup"
    CHECKPOINT_STALL = "checkpoint_stall"
    WAITING = "waiting"
    PAUSED = "paused"


RUNNING_PHASES = frozenset({Phase.PRODUCTIVE, Phase.LOST_WORK})
# The phases a fault can hide in until it is detected: the generation seemed to run or start.
UNDETECTED_PHASES = RUNNING_PHASES | {Phase.STARTUP}

Position = tuple[int, int]  # (epoch, step), as GenerationObservation compares progress


@dataclass(frozen=True)
class JobMoment:
    """What the accountant needs to know of the job at one instant."""

    state: JobState
    launched: bool  # a generation was ever launched
    live: bool  # a generation is launched and its stop was not decided
    progressing: bool  # the live generation reported a step, or counts as RUNNING without one
    position: Position | None  # the newest position any rank of the live generation reported


def phase_of(moment: JobMoment, high_water: Position | None, previous: Phase | None) -> Phase | None:
    """The phase the job is in; None once it COMPLETED (its wall time is over)."""
    state = moment.state
    if state is JobState.COMPLETED:
        return None
    if state in (JobState.PAUSED, JobState.FAILED):
        return Phase.PAUSED
    if state is JobState.WAITING or not moment.launched:
        return Phase.WAITING
    if not moment.live:
        return Phase.RELAUNCH
    if not moment.progressing:
        return Phase.STARTUP
    if moment.position is None:
        # RUNNING without a step seen by this leader (a script trainerd reads no progress from, or a
        # takeover before the first report): as it was.
        return previous if previous in RUNNING_PHASES else Phase.PRODUCTIVE
    return Phase.LOST_WORK if high_water is not None and moment.position < high_water else Phase.PRODUCTIVE


def fault_time(failure: Failure, observation: GenerationObservation | None, now: float,
               known_until: float | None = None) -> float:
    """When the fault behind `failure` most likely happened, from what the leader saw (never after `now`):
    the first failed exit's arrival, the lost node's last heartbeat (else the last step; for a node that never
    came back to a leader that took the generation over, `known_until`), the last step
    before a hang. A run of bad batches is no outage: it is detected at once (its steps are redone, lost work).
    Processes gone with a restarted agent, or stopped by their own agent when no coordinator answered it
    (fenced), died after the last step; when this leader took the generation
    over and saw none, after `known_until` (GoodputAccountant.known_until): the moment its predecessor
    last saved the totals, when trainerd itself may have stopped, taking its local agents with it."""
    if observation is None:
        return now
    at: float | None = None
    match failure.cause:
        case FailureCause.NODE_LOST:
            at = observation.heard_at.get(failure.node, observation.last_progress_at)
            if at is None and observation.ran_before_takeover:
                at = known_until  # a node that never came back to this leader (trainerd's own local agents too)
        case FailureCause.PROCESSES_GONE | FailureCause.FENCED:
            at = observation.last_progress_at
            if at is None and observation.ran_before_takeover:
                at = known_until
        case FailureCause.HANG:
            at = observation.silent_since()
        case FailureCause.BAD_BATCHES:
            at = now
        case _:
            first = observation.first_failure()
            at = None if first is None else first.observed_at
    return now if at is None else min(at, now)


@dataclass(frozen=True)
class GoodputSnapshot:
    """The accountant's totals as saved in etcd (`jobs/{job}/goodput`)."""

    seconds: dict[Phase, float] = field(default_factory=dict, hash=False)
    phase: Phase | None = Phase.WAITING  # when saved; None: the job COMPLETED
    high_water: Position | None = None
    stall_generation: int = 0  # the generation whose checkpoint stall is counted up to stall_counted_s
    stall_counted_s: float = 0.0
    saved_wall: float = 0.0  # the saving leader's wall clock

    @property
    def wall_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def ratio(self) -> float:
        """Productive over wall time (0 before any time passed)."""
        wall = self.wall_s
        return self.seconds.get(Phase.PRODUCTIVE, 0.0) / wall if wall > 0 else 0.0

    def to_json(self) -> dict:
        return {"seconds": {phase.value: round(s, 3) for phase, s in self.seconds.items()},
                "phase": None if self.phase is None else self.phase.value,
                "high_water": None if self.high_water is None else list(self.high_water),
                "stall_generation": self.stall_generation, "stall_counted_s": self.stall_counted_s,
                "saved_wall": self.saved_wall}

    @classmethod
    def from_json(cls, data: dict) -> "GoodputSnapshot":
        """Raises ValueError for a phase this trainerd does not know, or a negative total."""
        seconds = {Phase(name): float(s) for name, s in data["seconds"].items()}
        if any(not math.isfinite(s) or s < 0 for s in seconds.values()):
            raise ValueError(f"goodput totals must be finite and not negative: {data['seconds']}")
        phase, high_water = data.get("phase"), data.get("high_water")
        return cls(seconds, None if phase is None else Phase(phase),
                   None if high_water is None else (int(high_water[0]), int(high_water[1])),
                   int(data.get("stall_generation", 0)), float(data.get("stall_counted_s", 0.0)),
                   float(data.get("saved_wall", 0.0)))


class GoodputAccountant:
    """Accrues the time since its last call to the current phase on every call.

    `observe` is called whenever the job's state, generation or progress may have changed (every
    reconcile pass, every commit and launch, every progress report), so a phase is never more than one
    pass late. Taking over from a `saved` snapshot, the seconds between that save and now (by the two
    leaders' wall clocks, nothing when they disagree) go to the phase it names, as part of its current
    segment: a fault found after the takeover (processes that died with trainerd) can move them to detection.
    """

    def __init__(self, clock: Clock, saved: GoodputSnapshot | None = None) -> None:
        self._clock = clock
        saved = saved or GoodputSnapshot(saved_wall=clock.wall())
        self._seconds = {phase: saved.seconds.get(phase, 0.0) for phase in Phase}
        self._phase = saved.phase
        self.high_water = saved.high_water
        self._stall_generation = saved.stall_generation
        self._stall_counted_s = saved.stall_counted_s
        unseen_s = max(0.0, clock.wall() - saved.saved_wall) if self._phase is not None else 0.0
        if self._phase is not None:
            self._seconds[self._phase] += unseen_s
        self._last = clock.now()
        # The moment (on this leader's clock) up to which the phase is known: the saved totals' moment.
        self.known_until = self._last - unseen_s
        self._segment_s = unseen_s  # seconds of the current phase since it began, still in that phase

    @property
    def phase(self) -> Phase | None:
        return self._phase

    def observe(self, moment: JobMoment) -> Phase | None:
        """Accrue up to now, then enter the phase `moment` puts the job in."""
        self._accrue()
        if moment.live and moment.position is not None and (self.high_water is None or
                                                            moment.position > self.high_water):
            self.high_water = moment.position
        phase = phase_of(moment, self.high_water, self._phase)
        if phase != self._phase:
            self._phase, self._segment_s = phase, 0.0
        return phase

    def fault_detected(self, fault_at: float) -> float:
        """A failure was just committed; the seconds since `fault_at` that the current phase holds go
        to detection. Returns the seconds moved."""
        self._accrue()
        if self._phase not in UNDETECTED_PHASES:
            return 0.0
        return self._move(Phase.DETECTION, self._clock.now() - fault_at)

    def checkpoint_stall(self, generation: int, stalled_s: float) -> float:
        """A rank of `generation` reports its step loop blocked `stalled_s` in all on checkpoint saves;
        what is new of it (over every rank's earlier reports) moves from the running phase to
        checkpoint_stall. Returns the seconds moved."""
        if generation != self._stall_generation:
            if generation < self._stall_generation:
                return 0.0
            self._stall_generation, self._stall_counted_s = generation, 0.0
        new = stalled_s - self._stall_counted_s
        if not math.isfinite(new) or new <= 0:
            return 0.0
        self._stall_counted_s = stalled_s
        self._accrue()
        if self._phase not in RUNNING_PHASES:
            return 0.0
        return self._move(Phase.CHECKPOINT_STALL, new)

    def snapshot(self) -> GoodputSnapshot:
        """The totals up to now."""
        self._accrue()
        return GoodputSnapshot(dict(self._seconds), self._phase, self.high_water, self._stall_generation,
                               self._stall_counted_s, self._clock.wall())

    def _accrue(self) -> None:
        now = self._clock.now()
        elapsed, self._last = max(0.0, now - self._last), now
        if self._phase is not None:
            self._seconds[self._phase] += elapsed
            self._segment_s += elapsed

    def _move(self, to: Phase, seconds: float) -> float:
        """Move up to `seconds` of the current segment from its phase to `to`."""
        assert self._phase is not None
        moved = min(max(0.0, seconds), self._segment_s, self._seconds[self._phase])
        self._seconds[self._phase] -= moved
        self._seconds[to] += moved
        self._segment_s -= moved
        return moved
