"""The examples' `--min-step-ms MS` (trainer/examples/step_floor.py): its parsing, and that a step sleeps only
for what is left of the floor (a step slower than the floor does not sleep at all)."""

from __future__ import annotations

import argparse

import pytest

from trainer.examples import step_floor as module
from trainer.examples.step_floor import min_step_ms, pad_step


def test_milliseconds_from_0_to_10000() -> None:
    assert [min_step_ms(text) for text in ("0", "12", "2.5", "10000")] == [0.0, 12.0, 2.5, 10_000.0]


@pytest.mark.parametrize("text", ["", "x", "-1", "10001", "nan", "inf", "-inf", "1e9"])
def test_anything_else_is_refused_in_one_line(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="is not a number of milliseconds from 0 to 10000"):
        min_step_ms(text)


@pytest.mark.parametrize("now, floor_ms, sleeps", [(100.004, 10, [0.006]), (100.02, 10, []), (100.0, 0, [])])
def test_a_step_sleeps_what_is_left_of_the_floor(monkeypatch: pytest.MonkeyPatch, now: float, floor_ms: float,
                                                 sleeps: list[float]) -> None:
    slept: list[float] = []
    monkeypatch.setattr(module.time, "perf_counter", lambda: now)
    monkeypatch.setattr(module.time, "sleep", slept.append)
    pad_step(100.0, floor_ms)
    assert slept == pytest.approx(sleeps)
