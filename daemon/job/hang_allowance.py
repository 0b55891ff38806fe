"""How long a generation may go without a new step before it is judged hung: adapted to its step time.

A job whose steps take 0.2 s and that stops is hung after seconds, not after job.hang_timeout_s; one
whose steps take 5 s is given 50 s. The allowance is STEP_TIME_FACTOR x the slowest of the
generation's newest intervals between new steps (observation.StepInterval, at most STEP_TIMES_KEPT;
of 100, the p99 is the slowest), at least job.hang_floor_s, at most job.hang_timeout_s. Phases in
which a step legitimately takes far longer than the measured ones get hang_timeout_s whole: the
first MEASURED_AFTER_STEPS new steps (compilation, warm-up), a step that saves a checkpoint or an
in-memory snapshot (or a save asked for), an evaluation, a new epoch's beginning, and steps read from
a script's output (whose saves and epoch ends trainerd cannot see). Intervals that held a save are no
step time either, and are left out of the measure.
"""

from __future__ import annotations

from dataclasses import dataclass

from daemon.config import JobSettings
from daemon.job.observation import GenerationObservation

STEP_TIME_FACTOR = 10.0
# The generation's first new steps compile the graph and warm up: their times say nothing of a step's.
MEASURED_AFTER_STEPS = 20


@dataclass(frozen=True)
class HangAllowance:
    seconds: float
    why: str  # how it was chosen, for the hang's message

    @classmethod
    def whole(cls, spec: JobSettings) -> HangAllowance:
        return cls(spec.hang_timeout_s, f"hang_timeout_s {spec.hang_timeout_s:g}")


def hang_allowance(spec: JobSettings, observation: GenerationObservation, save_asked: bool) -> HangAllowance:
    """The silence after which `observation`'s generation is hung; `save_asked`: a checkpoint trainerd asked
    for (a reshape's, a pause's) is pending."""
    if not observation.runtime_progress or observation.new_steps < MEASURED_AFTER_STEPS or save_asked \
            or observation.epoch_began or any(p.evaluating for p in observation.progress.values()):
        return HangAllowance.whole(spec)
    newest = observation.newest_position
    assert newest is not None  # the runtime reported steps
    newest_interval = observation.step_intervals[-1] if observation.step_intervals else None
    stride = 1 if newest_interval is None else max(1, newest_interval.to_step - newest_interval.after_step)
    if _saves_between(spec, newest[1], newest[1] + stride):
        return HangAllowance.whole(spec)  # the next step saves (or the newest one does, after its report)
    measured = [i.seconds for i in observation.step_intervals if not _saves_between(spec, i.after_step, i.to_step)]
    if not measured:
        return HangAllowance.whole(spec)
    slowest = max(measured)
    seconds = min(spec.hang_timeout_s, max(spec.hang_floor_s, STEP_TIME_FACTOR * slowest))
    why = (f"{STEP_TIME_FACTOR:g} × the slowest of the last {len(measured)} step times, {slowest:.2g}s; "
           f"floor {spec.hang_floor_s:g}s; hang_timeout_s {spec.hang_timeout_s:g}")
    return HangAllowance(seconds, why)


def _saves_between(spec: JobSettings, first: int, last: int) -> bool:
    """A step from `first` to `last` (both included) saves a checkpoint or an in-memory snapshot. An "auto"
    snapshot interval is the workers' to choose; its saves stall a step by at most 2% of the step time."""
    every = [n for n in (spec.checkpoint.every_steps, spec.checkpoint.memory_every_steps)
             if isinstance(n, int) and n > 0]
    return any(last // n * n >= first for n in every)

