"""Replay before blame: what a step the guard refused turns out to be. Pure: no MindSpore.

The guard (`trainer.runtime.guard`) keeps a suspect update out of the weights: a non-finite loss or norm, or
a norm spike. A suspect step is not yet a bad batch. Three things make one, and they call for three answers:
- bad data: the samples themselves (a corrupted record, scrambled labels). The same samples on the same
  weights give the same numbers again, and their loss stands out. Skip them, for good: the skip ledger.
- a bad device: a device that computed wrong once (silent data corruption, a flaky link). The same step
  computed again comes out clean. Keep the samples, take the clean result, and name the device.
- a healthy excursion: the model's own gradient norm swinging (late in training it swings by orders of
  magnitude). The same numbers again, and a loss like the others. Apply the update: nothing is wrong.

So `StepJudge.run` computes a refused step once more on the same weights and the same batch (a refused
update changed nothing, so the replay sees exactly what the first attempt saw) and compares:
- the replay differs from the first attempt: the fault was not the data. The replay stands (its update is
  applied when the guard accepts it), no ledger entry, and each rank whose own gradients differ between the
  two attempts is named (`local_differs`): its device computed wrong. Every rank sees the same global loss
  and norm, so every rank reaches the same verdict; each rank knows only its own local result.
- the same non-finite value again: bad data (a NaN is never applied).
- the same spike again: bad data when the loss stands out (`guard_policy.loss_raised`), else an excursion,
  whose replay was run forced: its update is applied and moves the guard's statistics.
Computing is deterministic on one device (the same kernels on the same inputs give the same bits), which
is what lets a replay tell a device from the data; a device that computes the same wrong numbers twice
looks like bad data, and is caught, if at all, by the job's other ranks never agreeing with it.

The rule must never become the fault: when more than MAX_SPIKES_IN_WINDOW of the last SPIKE_WINDOW steps
were spikes judged bad data, the statistics are what is wrong (a phase of training the guard has not
learnt). The step is then applied (forced), the guard forgets its statistics and learns them again from the
next steps (`REBASELINED`), and none of those steps goes into the ledger. Excursions do not count: they are
applied already, and a norm that swings by orders of magnitude late in training makes hundreds of them.

What it costs: nothing on an accepted step; one more step's compute on a refused one (MLP to convergence:
a few in a thousand steps, `bench/guard.py`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum, StrEnum

from proto.progress_datagram import BadBatchReason
from trainer.runtime.guard_policy import GRAD_NORM_SPIKE, GuardSettings, GuardState, loss_raised, skip_reason

# A window of steps, and how many spikes judged bad data in it mean that the rule, not the data, is wrong: a bad
# batch is rare (a corrupted shard spans a few batches, which max_consecutive_spikes and the ledger deal
# with), while a rule out of step with training refuses steps by the dozen (280-430 a minute in the run that
# made this necessary).
SPIKE_WINDOW = 200
MAX_SPIKES_IN_WINDOW = 10


class AttemptKind(IntEnum):
    """Which computation of a step an attempt is (the compiled step takes it as an int32 input): the first
    computes this rank's own gradient norm only when the guard refuses it (it costs a reduction over every
    gradient), a replay always, and a forced replay has its finite spike accepted."""

    FIRST = 0
    REPLAY = 1
    FORCED_REPLAY = 2


@dataclass(frozen=True)
class Attempt:
    """One computation of a step: the global loss and norm and the guard's decision (the same on every rank),
    and this rank's own gradient norm before the all-reduce."""

    loss: float
    norm: float
    accepted: bool
    local_norm: float

    def same_global(self, other: Attempt) -> bool:
        return _same(self.loss, other.loss) and _same(self.norm, other.norm)


class Verdict(StrEnum):
    ACCEPTED = "accepted"        # the guard accepted the first attempt: the usual step
    BAD_DATA = "bad_data"        # reproduced: skipped, and its samples go into the ledger
    DEVICE_FAULT = "device_fault"  # the replay differed: the replay stands, no ledger entry
    EXCURSION = "excursion"      # a reproduced spike with an ordinary loss: applied
    REBASELINED = "rebaselined"  # a reproduced spike beyond the window's share: applied, statistics forgotten


@dataclass(frozen=True)
class StepOutcome:
    """What became of one step. `standing` is the attempt whose result the step keeps (the replay, when there
    was one); `first` the refused first attempt; `reason` why it was refused."""

    verdict: Verdict
    standing: Attempt
    first: Attempt | None = None
    reason: BadBatchReason | None = None

    @property
    def applied(self) -> bool:
        """Whether the optimizer updated the weights in this step."""
        return self.standing.accepted

    @property
    def skipped_as_bad(self) -> bool:
        """Whether the step's samples go into the skip ledger."""
        return self.verdict is Verdict.BAD_DATA

    @property
    def local_differs(self) -> bool:
        """This rank's own gradients came out otherwise on the replay: its device is suspect."""
        return self.first is not None and not _same(self.first.local_norm, self.standing.local_norm)

    def describe(self) -> str:
        """One line for the log and the events."""
        standing = self.standing
        if self.first is None:
            return f"loss {standing.loss:.4g} grad norm {standing.norm:.4g}"
        return (f"{self.reason}: loss {self.first.loss:.4g} grad norm {self.first.norm:.4g}, replayed: loss "
                f"{standing.loss:.4g} grad norm {standing.norm:.4g}")


class StepJudge:
    """Runs a step and, when the guard refuses it, its replay; says what the step was.

    `attempt(kind) -> Attempt` computes the whole step on this rank (forward, backward, all-reduce, the
    guard, the update when accepted) and must leave nothing changed when the guard refuses; `state()` reads
    the guard's statistics; `rebaseline(loss, norm)` makes the guard forget them. Every rank must call `run`
    for every step, in step with the others: the replay is a collective step too.
    """

    def __init__(self, settings: GuardSettings, state: Callable[[], GuardState],
                 rebaseline: Callable[[float, float], None]) -> None:
        self._settings = settings
        self._state = state
        self._rebaseline = rebaseline
        self._step = 0
        self._spikes: deque[int] = deque()  # the steps of spikes judged bad data within the window

    def run(self, attempt: Callable[[AttemptKind], Attempt]) -> StepOutcome:
        self._step += 1
        first = attempt(AttemptKind.FIRST)
        if first.accepted:
            return StepOutcome(Verdict.ACCEPTED, first)
        reason = skip_reason(False, first.loss, first.norm)
        while self._spikes and self._spikes[0] <= self._step - SPIKE_WINDOW:
            self._spikes.popleft()
        spike = reason is GRAD_NORM_SPIKE
        raised = spike and loss_raised(self._settings, self._state(), first.loss)
        over_share = spike and len(self._spikes) >= MAX_SPIKES_IN_WINDOW
        forced = spike and (over_share or not raised)
        replay = attempt(AttemptKind.FORCED_REPLAY if forced else AttemptKind.REPLAY)
        if not replay.same_global(first):
            # The replay stands. Refused too (otherwise), it tells no more which attempt was wrong: the step
            # is then lost as a crashed one's would be, and its samples are not blamed either.
            return StepOutcome(Verdict.DEVICE_FAULT, replay, first, reason)
        if not spike:
            return StepOutcome(Verdict.BAD_DATA, replay, first, reason)
        if not raised:
            return StepOutcome(Verdict.EXCURSION, replay, first, reason)
        if over_share:
            self._spikes.clear()
            self._rebaseline(replay.loss, replay.norm)
            return StepOutcome(Verdict.REBASELINED, replay, first, reason)
        self._spikes.append(self._step)
        return StepOutcome(Verdict.BAD_DATA, replay, first, reason)


def _same(a: float, b: float) -> bool:
    """Bit-for-bit equal as the host reads them, NaN equal to NaN (a reproduced NaN is the same result)."""
    return a == b or (math.isnan(a) and math.isnan(b))
