"""Following a log file: only what is appended after the start, in bounded reads, and the rest at exit."""

from __future__ import annotations

from pathlib import Path

from agent.output_follower import OutputFollower

LINES = [f"epoch: 1 step: {step}, loss is 0.{step}\n" for step in range(1, 10)]


def test_only_what_is_appended_after_the_start_is_read(tmp_path: Path) -> None:
    log = tmp_path / "rank0.log"
    log.write_text("epoch: 9 step: 99, loss is 1.0\n")  # an earlier process's output
    follower = OutputFollower(log)
    assert follower.read() == []
    with open(log, "a") as f:
        f.write(LINES[0])
    assert [(o.epoch, o.step, o.loss) for o in follower.read()] == [(1, 1, 0.1)]
    assert follower.read() == []


def test_bounded_reads_see_every_line_once_whatever_the_split(tmp_path: Path) -> None:
    log = tmp_path / "rank0.log"
    follower = OutputFollower(log)
    log.write_text("".join(LINES))
    steps: list[int] = []
    for _ in range(100):
        steps += [o.step for o in follower.read(limit=7)]  # cuts lines anywhere
    assert steps == list(range(1, 10))
    assert follower.offset == log.stat().st_size


def test_finish_reads_the_rest_and_the_last_unterminated_line(tmp_path: Path) -> None:
    log = tmp_path / "rank0.log"
    follower = OutputFollower(log)
    log.write_text("".join(LINES[:3]) + "epoch: 1 step: 4, loss is 0.25")
    assert [o.step for o in follower.read(limit=10)] == []
    assert [(o.step, o.loss) for o in follower.finish()] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.25)]


def test_a_missing_log_reads_nothing(tmp_path: Path) -> None:
    follower = OutputFollower(tmp_path / "never-written.log")
    assert follower.read() == [] and follower.finish() == []
