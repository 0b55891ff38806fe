"""Replay before blame, the pure judge (trainer/runtime/step_replay.py) with scripted attempts: each test says
what the step's two computations give and checks what the step is taken for."""

from __future__ import annotations

import math

from trainer.runtime.guard_policy import GuardSettings, GuardState
from trainer.runtime.step_replay import MAX_SPIKES_IN_WINDOW, SPIKE_WINDOW, Attempt, AttemptKind, StepJudge, Verdict

SETTINGS = GuardSettings()
# A guard past its warm-up whose losses have been about 0.01 (log -4.6), spread 0.5 in the log.
CONVERGED = GuardState(log_norm_mean=-3.0, log_norm_var=1.0, accepted_steps=500, log_loss_mean=-4.6,
                       log_loss_var=0.25)


class Scripted:
    """attempt(kind) hands out the scripted attempts in turn and records whether each was forced."""

    def __init__(self, *attempts: Attempt) -> None:
        self.attempts = list(attempts)
        self.forced: list[bool] = []

    def __call__(self, kind: AttemptKind) -> Attempt:
        force = kind is AttemptKind.FORCED_REPLAY
        self.forced.append(force)
        attempt = self.attempts.pop(0)
        return Attempt(attempt.loss, attempt.norm, attempt.accepted or force, attempt.local_norm)


def judge(state: GuardState = CONVERGED) -> tuple[StepJudge, list[tuple[float, float]]]:
    rebaselined: list[tuple[float, float]] = []
    return StepJudge(SETTINGS, lambda: state, lambda loss, norm: rebaselined.append((loss, norm))), rebaselined


def test_an_accepted_step_is_computed_once() -> None:
    step = Scripted(Attempt(0.01, 0.05, True, 0.04))
    outcome = judge()[0].run(step)
    assert outcome.verdict is Verdict.ACCEPTED and outcome.applied and step.forced == [False]


def test_a_replay_that_differs_blames_the_device_keeps_the_samples_and_names_the_rank_whose_result_moved() -> None:
    corrupted = Attempt(0.01, 500.0, False, 1000.0)  # this rank's gradients x1e4, the loss untouched
    clean = Attempt(0.01, 0.05, True, 0.1)
    outcome = judge()[0].run(Scripted(corrupted, clean))
    assert outcome.verdict is Verdict.DEVICE_FAULT and outcome.applied and not outcome.skipped_as_bad
    assert outcome.standing == clean and outcome.local_differs
    # Another rank sees the same global figures but its own result did not move: it is not named.
    other = judge()[0].run(Scripted(Attempt(0.01, 500.0, False, 0.1), Attempt(0.01, 0.05, True, 0.1)))
    assert other.verdict is Verdict.DEVICE_FAULT and not other.local_differs


def test_a_nan_from_a_device_is_replayed_clean_and_a_nan_from_the_data_is_bad_data() -> None:
    flaky = judge()[0].run(Scripted(Attempt(math.nan, math.nan, False, math.nan), Attempt(0.01, 0.05, True, 0.1)))
    assert flaky.verdict is Verdict.DEVICE_FAULT and flaky.local_differs
    step = Scripted(Attempt(math.nan, math.nan, False, math.nan), Attempt(math.nan, math.nan, False, math.nan))
    bad = judge()[0].run(step)
    assert bad.verdict is Verdict.BAD_DATA and bad.skipped_as_bad and not bad.applied and step.forced == [False, False]
    assert bad.reason == "nonfinite_loss"


def test_a_reproduced_spike_with_an_ordinary_loss_is_an_excursion_and_is_applied() -> None:
    spike = Attempt(0.012, 5.0, False, 2.0)  # the norm 100 x its mean, the loss as usual
    step = Scripted(spike, spike)
    outcome = judge()[0].run(step)
    assert outcome.verdict is Verdict.EXCURSION and outcome.applied and not outcome.skipped_as_bad
    assert step.forced == [False, True]


def test_a_reproduced_spike_that_raises_the_loss_is_bad_data() -> None:
    scrambled = Attempt(2.3, 5.0, False, 2.0)  # labels scrambled: the loss of a guess, 230 x the usual
    step = Scripted(scrambled, scrambled)
    outcome = judge()[0].run(step)
    assert outcome.verdict is Verdict.BAD_DATA and outcome.skipped_as_bad and not outcome.applied
    assert step.forced == [False, False] and outcome.reason == "grad_norm_spike"


def test_a_spike_in_the_loss_s_warm_up_is_not_blamed_on_the_loss() -> None:
    early = GuardState(0.0, 0.0, SETTINGS.warmup_steps - 1)
    spike = Attempt(50.0, 5.0, False, 2.0)
    assert judge(early)[0].run(Scripted(spike, spike)).verdict is Verdict.EXCURSION


def test_more_reproduced_spikes_than_the_window_allows_rebaseline_the_guard_and_skip_nothing() -> None:
    """A rule out of step with training (the cascade that failed a converging job) cannot go on skipping."""
    step_judge, rebaselined = judge()
    bad = Attempt(2.3, 5.0, False, 2.0)
    verdicts = [step_judge.run(Scripted(bad, bad)).verdict for _ in range(MAX_SPIKES_IN_WINDOW)]
    assert verdicts == [Verdict.BAD_DATA] * MAX_SPIKES_IN_WINDOW
    outcome = step_judge.run(Scripted(bad, bad))
    assert outcome.verdict is Verdict.REBASELINED and outcome.applied and not outcome.skipped_as_bad
    assert rebaselined == [(2.3, 5.0)]
    # The window starts again: the next spike is judged on its own.
    assert step_judge.run(Scripted(bad, bad)).verdict is Verdict.BAD_DATA


def test_spikes_older_than_the_window_do_not_count() -> None:
    step_judge, rebaselined = judge()
    bad, good = Attempt(2.3, 5.0, False, 2.0), Attempt(0.01, 0.05, True, 0.1)
    for _ in range(MAX_SPIKES_IN_WINDOW):
        step_judge.run(Scripted(bad, bad))
    for _ in range(SPIKE_WINDOW):
        step_judge.run(Scripted(good))
    assert step_judge.run(Scripted(bad, bad)).verdict is Verdict.BAD_DATA and not rebaselined
