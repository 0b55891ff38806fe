"""The examples' `--slow-start RANK:SECONDS` (trainer/examples/slow_start.py): its parsing, and that only that
rank of the first generation sleeps (the relaunch must not, or the job could never recover)."""

from __future__ import annotations

import argparse

import pytest

from trainer.examples import slow_start as module
from trainer.examples.slow_start import SlowStart, slow_start
from trainer.runtime.rank_context import RankContext, Role


def context(rank: int, generation: int) -> RankContext:
    return RankContext(role=Role.WORKER, job="job", generation=generation, rank=rank, world_size=2, local_rank=0,
                       device_id=0, batch=None, progress_socket=None, scheduler_address="127.0.0.1:1")


def test_rank_colon_seconds() -> None:
    assert slow_start("1:20") == SlowStart(1, 20.0)
    assert slow_start("0:2.5") == SlowStart(0, 2.5)


@pytest.mark.parametrize("text", ["1", "1:", ":20", "x:1", "-1:20", "1:-2", "1:nan", "1:inf", "1:20:3"])
def test_anything_else_is_refused_in_one_line(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="is not RANK:SECONDS"):
        slow_start(text)


@pytest.mark.parametrize("rank, generation, sleeps", [(1, 1, True), (0, 1, False), (1, 2, False)])
def test_only_that_rank_of_the_first_generation_sleeps(monkeypatch: pytest.MonkeyPatch, rank: int, generation: int,
                                                       sleeps: bool) -> None:
    slept: list[float] = []
    monkeypatch.setattr(module.time, "sleep", slept.append)
    SlowStart(1, 20.0).wait_before_first_step(context(rank, generation))
    assert slept == ([20.0] if sleeps else [])
