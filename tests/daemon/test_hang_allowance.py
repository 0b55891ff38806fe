"""A hang is judged after an allowance adapted to the job's step time (daemon/job/hang_allowance.py):
10 x the slowest recent step, at least hang_floor_s, at most hang_timeout_s; and after hang_timeout_s
whole while a step may legitimately take far longer (warm-up, a save, an evaluation, a new epoch, steps
read from a script's output)."""

from __future__ import annotations

import asyncio

import pytest

from daemon.config import JobSettings
from daemon.job.hang_allowance import MEASURED_AFTER_STEPS, hang_allowance
from daemon.job.observation import STEP_TIMES_KEPT, GenerationObservation, ProgressReport
from daemon.job.state import FailureCause
from proto.vocabulary import JobState
from tests.daemon.job_sim import SimCluster, job_settings, launched_cluster, running_cluster

HANG_TIMEOUT_S = 300.0  # checkpoints every 10 steps (job_sim)
FLOOR_S = 10.0  # below the default (30 s), for the figures of the examples


def run(coro) -> None:
    asyncio.run(coro)


async def steady(sim: SimCluster, first: int, last: int, every_s: float, **report) -> None:
    """Every rank reports the steps from `first` to `last`, one each `every_s`."""
    for step in range(first, last + 1):
        sim.step(step, **report)
        await sim.tick(every_s)


async def silent(sim: SimCluster, seconds: float) -> None:
    """Let `seconds` pass without a new step, in ticks of at most 10 s (heartbeats keep flowing)."""
    while seconds > 0:
        await sim.tick(min(seconds, 10.0))
        seconds -= 10.0


def hang_message(sim: SimCluster) -> str:
    failure = sim.job.record.last_failure
    assert sim.state is JobState.RECOVERING and failure.cause is FailureCause.HANG
    return failure.message


def test_a_steady_fast_job_that_stops_is_hung_after_the_floor_not_hang_timeout_s() -> None:
    async def scenario() -> None:
        sim = await running_cluster(hang_timeout_s=HANG_TIMEOUT_S, hang_floor_s=FLOOR_S)
        await steady(sim, 11, 45, 0.2)
        await sim.tick(9.5)  # 9.7 s since step 45
        assert sim.state is JobState.RUNNING
        await sim.tick(0.5)
        assert hang_message(sim).startswith(
            "no rank of generation 1 reported a new step for 10s (10 × the slowest of the last 28 step times, "
            "0.2s; floor 10s; hang_timeout_s 300); rank 0 on node a was behind at step 45")
    run(scenario())


def test_a_job_whose_steps_take_5s_is_hung_after_50s() -> None:
    async def scenario() -> None:
        sim = await running_cluster(hang_timeout_s=HANG_TIMEOUT_S, hang_floor_s=FLOOR_S)
        await steady(sim, 11, 35, 5.0)  # the last tick is 5 s of its silence
        await sim.tick(44.5)
        assert sim.state is JobState.RUNNING
        await sim.tick(1.0)
        assert "(10 × the slowest of the last 20 step times, 5s; floor 10s; hang_timeout_s 300)" in hang_message(sim)
    run(scenario())


def test_no_hang_within_hang_timeout_s_while_the_first_steps_compile_and_warm_up() -> None:
    async def scenario() -> None:
        sim = await running_cluster(hang_timeout_s=HANG_TIMEOUT_S, hang_floor_s=FLOOR_S)
        await steady(sim, 11, 11 + MEASURED_AFTER_STEPS - 4, 0.2)  # with steps 1 and 10: 19 new steps
        await silent(sim, HANG_TIMEOUT_S - 1)
        assert sim.state is JobState.RUNNING
        await sim.tick(1.5)
        assert "(hang_timeout_s 300)" in hang_message(sim)
    run(scenario())


def test_no_hang_within_hang_timeout_s_before_a_checkpoint_step_and_its_save_is_no_step_time() -> None:
    async def scenario() -> None:
        sim = await running_cluster(hang_timeout_s=HANG_TIMEOUT_S, hang_floor_s=FLOOR_S)
        await steady(sim, 11, 49, 0.2)  # step 50 saves (checkpoint.every_steps 10)
        await silent(sim, 100.0)
        assert sim.state is JobState.RUNNING
        await steady(sim, 50, 52, 0.2)  # the 100 s before step 50 is no step's time
        await sim.tick(10.0)
        assert "0.2s; floor 10s" in hang_message(sim)
    run(scenario())


def test_no_hang_within_hang_timeout_s_during_an_evaluation() -> None:
    async def scenario() -> None:
        sim = await running_cluster(hang_timeout_s=HANG_TIMEOUT_S, hang_floor_s=FLOOR_S)
        await steady(sim, 11, 45, 0.2)
        sim.step(45, evaluating=True)
        await silent(sim, 100.0)
        assert sim.state is JobState.RUNNING
        await steady(sim, 46, 47, 0.2)  # the evaluation's 100 s is no step time
        await sim.tick(10.0)
        assert "0.2s; floor 10s" in hang_message(sim)
    run(scenario())


def test_no_hang_within_hang_timeout_s_as_a_new_epoch_begins() -> None:
    async def scenario() -> None:
        sim = await running_cluster(hang_timeout_s=HANG_TIMEOUT_S, hang_floor_s=FLOOR_S)
        await steady(sim, 11, 45, 0.2, epoch=1)
        sim.step(46, epoch=2)
        await silent(sim, 100.0)
        assert sim.state is JobState.RUNNING
        await silent(sim, HANG_TIMEOUT_S - 100.0 - 1)
        assert sim.state is JobState.RUNNING
        await sim.tick(1.5)
        assert "(hang_timeout_s 300)" in hang_message(sim)
    run(scenario())


def test_steps_read_from_output_are_judged_after_hang_timeout_s() -> None:
    async def scenario() -> None:
        sim = await launched_cluster(hang_timeout_s=HANG_TIMEOUT_S, hang_floor_s=FLOOR_S, global_batch=None, micro_batch=None)
        await steady(sim, 1, 45, 0.2, epoch=1, from_output=True)
        await silent(sim, HANG_TIMEOUT_S - 1)
        assert sim.state is JobState.RUNNING
        await sim.tick(1.5)
        assert "(hang_timeout_s 300)" in hang_message(sim)
    run(scenario())


def observed(step_times: list[float]) -> GenerationObservation:
    """A generation whose rank 0 reported a new step after each of `step_times` (from step 1)."""
    observation, now = GenerationObservation(1), 0.0
    for step, seconds in enumerate([0.0, *step_times], start=1):
        now += seconds
        observation.record_progress(ProgressReport(0, step, 0.5, 1.0, 10.0, step), now)
    return observation


def spec(**overrides) -> JobSettings:
    return job_settings(**{"hang_timeout_s": HANG_TIMEOUT_S, "hang_floor_s": FLOOR_S,
                           "checkpoint": {"dir": "/ckpt", "every_steps": 0}, **overrides})


def test_the_step_time_window_is_bounded_and_forgets_old_steps() -> None:
    observation = observed([5.0] * 30 + [0.2] * 1000)
    assert len(observation.step_intervals) == STEP_TIMES_KEPT
    assert hang_allowance(spec(), observation, save_asked=False).seconds == 10.0  # the 5 s steps are forgotten
    assert hang_allowance(spec(hang_floor_s=1.0), observation, save_asked=False).seconds == pytest.approx(2.0)


def test_the_allowance_is_capped_by_hang_timeout_s_and_whole_while_a_save_is_asked_for() -> None:
    slow = observed([60.0] * 30)
    assert hang_allowance(spec(), slow, save_asked=False).seconds == HANG_TIMEOUT_S
    fast = observed([0.2] * 30)
    assert hang_allowance(spec(), fast, save_asked=True).seconds == HANG_TIMEOUT_S
    every_5 = spec(checkpoint={"dir": "/ckpt", "every_steps": 0, "memory_every_steps": 5})
    assert hang_allowance(every_5, observed([0.2] * 26), save_asked=False).seconds == 10.0  # newest step 27
    assert hang_allowance(every_5, observed([0.2] * 28), save_asked=False).seconds == HANG_TIMEOUT_S  # 30 saves next
    assert hang_allowance(every_5, observed([0.2] * 29), save_asked=False).seconds == HANG_TIMEOUT_S  # 30 saves now
