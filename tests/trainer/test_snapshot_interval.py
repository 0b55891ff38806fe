"""How often "auto" snapshots into memory (pure logic, fake clock), and how the ranks of a generation agree
on the steps without a collective: rank 0 plans, the others follow its plan in the shared directory."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from common.clock import FakeClock
from trainer.runtime.memory_snapshots import PLAN_NAME, MemorySnapshots
from trainer.runtime.snapshot_interval import (
    FIRST_SNAPSHOT_AFTER,
    MAX_INTERVAL,
    MIN_PERIOD_S,
    StepTimes,
    interval_cap,
    interval_for,
)


def test_the_interval_is_the_smallest_that_keeps_the_stall_under_two_percent() -> None:
    # Steps of 20 s: every step spans the minimum period, and the stall decides.
    assert interval_for(0.2, 20.0, 1000) == 1          # 0.5% at every step
    assert interval_for(0.4, 20.0, 1000) == 1          # exactly 2%: not rounded up
    assert interval_for(0.41, 20.0, 1000) == 2
    assert interval_for(5.0, 10.0, 1000) == 25         # 5 / (25 x 10) = 2%
    assert 5.0 / (24 * 10.0) > 0.02
    assert interval_for(3.0, 0.01, 1000) == 1000       # capped
    assert interval_for(3.0, 0.01, 100) == 100
    assert interval_for(0.0, 20.0, 1000) == 1
    assert interval_for(0.1, 0.0, 50) == 50            # no step time measured: as rare as allowed


def test_snapshots_of_a_fast_model_are_at_least_the_minimum_period_apart() -> None:
    """A stall of 1 ms at 0.15 s steps would allow a snapshot every step; each also costs the agents a
    commit, a report and a peer copy, so they come at least MIN_PERIOD_S of training apart."""
    assert MIN_PERIOD_S == 10.0
    assert interval_for(0.001, 0.15, 1000) == 67       # 67 x 0.15 s >= 10 s > 66 x 0.15 s
    assert interval_for(0.001, 0.1, 1000) == 100       # exactly 10 s: not rounded up
    assert interval_for(0.001, 0.15, 50) == 50         # the disk interval still caps it
    assert interval_for(1.0, 0.15, 1000) == 334        # the stall asks for more: 1 / (334 x 0.15) <= 2%


def test_the_cap_is_the_disk_interval_when_smaller() -> None:
    assert interval_cap(100) == 100
    assert interval_cap(5000) == MAX_INTERVAL
    assert interval_cap(0) == interval_cap(None) == MAX_INTERVAL  # disk only on request


def test_step_times_leave_out_the_first_step_and_the_time_before_a_reset() -> None:
    clock = FakeClock()
    times = StepTimes(clock)
    clock.advance(9.0)  # the first step compiles: not timed
    times.step_ended()
    assert times.mean() is None
    for seconds in (0.2, 0.4):
        clock.advance(seconds)
        times.step_ended()
    assert times.mean() == pytest.approx(0.3)
    clock.advance(5.0)  # a snapshot's stall
    times.reset()
    clock.advance(0.1)
    times.step_ended()
    assert times.mean() == pytest.approx(0.1)


def ranks(tmp_path: Path, clock: FakeClock, world: int = 2, cap: int = 1000,
          generation: int = 1) -> list[MemorySnapshots]:
    return [MemorySnapshots(tmp_path, "auto", rank, world, generation, f"rank {rank}", clock, cap)
            for rank in range(world)]


def run(snapshots: list[MemorySnapshots], clock: FakeClock, steps: range, step_s: float,
        stall_s: float) -> list[int]:
    """Lockstep ranks: each step every rank asks `due` in rank order; rank 0 stalls for its snapshot (the
    stall it measures), the others follow. Returns the snapshot steps, checked equal on every rank."""
    taken: list[list[int]] = [[] for _ in snapshots]
    for step in steps:
        clock.advance(step_s)
        for rank, memory in enumerate(snapshots):
            if memory.due(step):
                taken[rank].append(step)
                if rank == 0:
                    clock.advance(stall_s)
                memory.snapshotted(step, stall_s)
    assert all(t == taken[0] for t in taken), taken
    return taken[0]


def test_all_ranks_snapshot_the_steps_rank_0_plans_from_its_measured_stall_and_step_time(tmp_path: Path) -> None:
    clock = FakeClock()
    # Resumed from step 40: the first snapshot FIRST_SNAPSHOT_AFTER steps in, then every stall / 2% steps.
    steps = run(ranks(tmp_path, clock, world=3), clock, range(41, 121), step_s=1.0, stall_s=0.5)
    assert steps == [45, 70, 95, 120]  # 0.5 s / (25 x 1 s) = 2%
    assert steps[0] == 40 + FIRST_SNAPSHOT_AFTER
    assert json.loads((tmp_path / PLAN_NAME).read_text()) == {"generation": 1, "after": 120, "next": 145}


def test_the_interval_follows_a_change_of_step_time_and_the_cap(tmp_path: Path) -> None:
    clock = FakeClock()
    memory = ranks(tmp_path, clock, cap=30)
    fast = run(memory, clock, range(1, 40), step_s=0.01, stall_s=0.05)  # 250 steps needed, capped at 30
    assert fast == [5, 35]
    slow = run(memory, clock, range(40, 80), step_s=5.0, stall_s=0.25)  # then every 3 steps
    assert slow[:3] == [65, 68, 71]


def test_an_explicit_interval_is_obeyed_and_writes_no_plan(tmp_path: Path) -> None:
    clock = FakeClock()
    memory = MemorySnapshots(tmp_path, 7, 0, 2, 1, "rank 0", clock, 1000)
    assert [step for step in range(1, 30) if memory.due(step)] == [7, 14, 21, 28]
    assert not (tmp_path / PLAN_NAME).exists()


def test_a_rank_that_passed_the_planned_step_says_so_and_follows_the_next_plan(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    leader, follower = ranks(tmp_path, clock)
    for step in range(1, 6):
        assert leader.due(step) == follower.due(step) == (step == 5)
    follower.snapshotted(5, 0.0)
    for step in range(6, 9):  # the follower runs ahead of a rank 0 that has not published yet
        assert not follower.due(step)
    clock.advance(1.0)
    leader.snapshotted(5, 0.05)
    plan = json.loads((tmp_path / PLAN_NAME).read_text())
    with caplog.at_level(logging.WARNING):
        assert not follower.due(plan["next"] + 1)
    assert f"planned an in-memory snapshot at step {plan['next']}" in caplog.text
    # Rank 0 plans again after it: the follower takes that one.
    leader.snapshotted(plan["next"], 0.05)
    following = json.loads((tmp_path / PLAN_NAME).read_text())["next"]
    assert follower.due(following)


def test_a_plan_of_another_generation_is_not_followed(tmp_path: Path) -> None:
    clock = FakeClock()
    (tmp_path / PLAN_NAME).write_text(json.dumps({"generation": 9, "after": 5, "next": 6}))
    _, follower = ranks(tmp_path, clock)
    assert [step for step in range(1, 6) if follower.due(step)] == [5]  # the first needs no plan
    follower.snapshotted(5, 0.0)
    assert not any(follower.due(step) for step in range(6, 20))
