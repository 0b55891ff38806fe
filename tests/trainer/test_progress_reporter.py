"""A real ProgressReporter talking to the agent's real asyncio receiver over a unix datagram socket."""

from __future__ import annotations

import asyncio
import socket
import stat
import time
from pathlib import Path

import pytest

from agent.progress_receiver import ProgressReceiver, open_progress_receiver
from proto.progress_datagram import (
    BadBatchReason,
    BadBatchReport,
    CheckpointReport,
    EventReport,
    ProgressMessage,
    StepReport,
    WorkerEvent,
)
from trainer.runtime import startup_times
from trainer.runtime.progress import ProgressReporter, StepPace


async def receive(path: Path, send, expected: int) -> tuple[list[ProgressMessage], ProgressReceiver]:
    """Open a receiver at `path`, run `send()`, and collect until `expected` messages arrived (5 s at most)."""
    messages: list[ProgressMessage] = []
    receiver = await open_progress_receiver(path, lambda message, sender_pid: messages.append(message))
    try:
        send()
        deadline = time.monotonic() + 5
        while len(messages) < expected and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return messages, receiver
    finally:
        receiver.close()


def test_reports_arrive_in_order_and_the_first_step_tells_how_the_start_went(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "progress.sock"
    monkeypatch.setattr(startup_times, "_seconds", {"comm_setup_s": 0.0, "load_s": 0.0})
    startup_times.joined_cluster(1.5)
    startup_times.loaded(0.25)

    def send() -> None:
        reporter.event(WorkerEvent.STARTED, step=0)
        time.sleep(0.05)  # the first step
        for step in range(1, 4):
            reporter.step(step, loss=1.0 / step, grad_norm=0.5, samples_per_s=100.0, consumed_samples=64 * step)
            reporter.add_checkpoint_stall(0.25 if step == 1 else 0.0)  # a save after step 1 blocked 0.25 s
        reporter.event(WorkerEvent.FINISHED, step=3)

    with ProgressReporter(str(path), job="llm", generation=2, rank=1) as reporter:
        messages, receiver = asyncio.run(receive(path, send, expected=5))
    first = messages[1]
    assert isinstance(first, StepReport) and first.startup is not None
    assert (first.startup.comm_setup_s, first.startup.load_s) == (1.5, 0.25)
    assert 0.05 <= first.startup.first_step_s < 5.0
    assert messages == [
        EventReport("llm", 2, 1, WorkerEvent.STARTED, 0),
        *(StepReport("llm", 2, 1, s, 1.0 / s, 0.5, 100.0, 64 * s, 0.0 if s == 1 else 0.25,
                     startup=first.startup if s == 1 else None) for s in range(1, 4)),
        EventReport("llm", 2, 1, WorkerEvent.FINISHED, 3),
    ]
    assert (reporter.sent, reporter.dropped, receiver.received, receiver.malformed) == (5, 0, 5, 0)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_checkpoint_and_bad_batch_reports_arrive(tmp_path: Path) -> None:
    path = tmp_path / "progress.sock"

    def send() -> None:
        reporter.bad_batch(7, sample_start=384, sample_end=448, reason=BadBatchReason.NONFINITE_GRAD_NORM,
                           loss=2.0, grad_norm=float("inf"))
        reporter.checkpoint(10, consumed_samples=640, path="/ckpt/llm/step_00000010")

    with ProgressReporter(str(path), job="llm", generation=2, rank=0) as reporter:
        messages, _ = asyncio.run(receive(path, send, expected=2))
    assert messages == [
        BadBatchReport("llm", 2, 0, 7, 384, 448, BadBatchReason.NONFINITE_GRAD_NORM, 2.0, float("inf")),
        CheckpointReport("llm", 2, 0, 10, 640, "/ckpt/llm/step_00000010"),
    ]


def test_hostile_datagrams_are_counted_and_dropped_and_the_receiver_keeps_going(tmp_path: Path) -> None:
    path = tmp_path / "progress.sock"

    def send() -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as hostile:
            for junk in (b"\x00" * 100, b'{"schema": 1}', b"x" * 60000):
                hostile.sendto(junk, str(path))
        reporter.step(1, loss=2.0, grad_norm=1.0, samples_per_s=10.0, consumed_samples=64)

    with ProgressReporter(str(path), job="llm", generation=2, rank=0) as reporter:
        messages, receiver = asyncio.run(receive(path, send, expected=1))
    assert [m.step for m in messages] == [1]
    assert (receiver.received, receiver.malformed) == (1, 3)


def test_a_stale_socket_file_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "progress.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as old:
        old.bind(str(path))  # an agent that died and left its socket file behind
    with ProgressReporter(str(path), job="llm", generation=1, rank=0) as reporter:
        messages, _ = asyncio.run(receive(path, lambda: reporter.event(WorkerEvent.STARTED, 0), expected=1))
    assert len(messages) == 1


def test_a_live_socket_or_a_regular_file_is_never_removed(tmp_path: Path) -> None:
    live = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as other_agent:
        other_agent.bind(str(live))
        with pytest.raises(FileExistsError, match="in use by another process"):
            asyncio.run(open_progress_receiver(live, print))
    regular = tmp_path / "notes.txt"
    regular.write_text("keep me")
    with pytest.raises(FileExistsError, match="exists and is not a socket"):
        asyncio.run(open_progress_receiver(regular, print))
    assert regular.read_text() == "keep me"


def test_without_a_socket_path_reporting_is_a_no_op() -> None:
    reporter = ProgressReporter(None, job="llm", generation=0, rank=0)
    reporter.step(1, loss=1.0, grad_norm=1.0, samples_per_s=1.0, consumed_samples=1)
    assert (reporter.sent, reporter.dropped) == (0, 0)


def test_a_missing_agent_costs_a_dropped_report_not_an_error(tmp_path: Path) -> None:
    with ProgressReporter(str(tmp_path / "nobody.sock"), job="llm", generation=0, rank=0) as reporter:
        reporter.step(1, loss=1.0, grad_norm=1.0, samples_per_s=1.0, consumed_samples=1)
    assert (reporter.sent, reporter.dropped) == (0, 1)


def test_a_full_agent_queue_never_blocks_training(tmp_path: Path) -> None:
    path = tmp_path / "stuck.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stuck_agent:  # bound, never reads
        stuck_agent.bind(str(path))
        with ProgressReporter(str(path), job="llm", generation=0, rank=0) as reporter:
            started = time.monotonic()
            for step in range(1, 5001):
                reporter.step(step, loss=1.0, grad_norm=1.0, samples_per_s=1.0, consumed_samples=step)
            assert time.monotonic() - started < 5
    assert reporter.dropped > 0
    assert reporter.sent + reporter.dropped == 5000


def test_an_event_waits_briefly_for_a_busy_agent_but_never_for_a_missing_one(tmp_path: Path) -> None:
    """`finished`, a committed checkpoint and a bad batch are superseded by nothing, so each gets a
    bounded wait when the agent's queue is full."""
    path = tmp_path / "stuck.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stuck_agent:
        stuck_agent.bind(str(path))
        with ProgressReporter(str(path), job="llm", generation=0, rank=0, event_wait_s=0.3) as reporter:
            while reporter.dropped == 0:  # fill the queue
                reporter.step(1, loss=1.0, grad_norm=1.0, samples_per_s=1.0, consumed_samples=1)
            for report in (lambda: reporter.event(WorkerEvent.FINISHED, step=1),
                           lambda: reporter.checkpoint(1, consumed_samples=1, path="/ckpt/step_00000001"),
                           lambda: reporter.bad_batch(1, 0, 1, BadBatchReason.NONFINITE_LOSS, float("nan"), 1.0)):
                started = time.monotonic()
                report()
                assert 0.3 <= time.monotonic() - started < 2
            assert reporter.dropped == 4
    with ProgressReporter(str(tmp_path / "nobody.sock"), job="llm", generation=0, rank=0) as reporter:
        started = time.monotonic()
        reporter.event(WorkerEvent.FINISHED, step=1)
        assert time.monotonic() - started < 0.1
        assert reporter.dropped == 1


def test_the_pace_counts_the_time_between_steps() -> None:
    """A job whose steps take 10 ms but which waits 90 ms for data before each trains 10 steps a second,
    not 100: the coordinator's checkpoint lead is taken from this rate."""
    now = [100.0]
    pace = StepPace(clock=lambda: now[0])
    rates = []
    for _ in range(3):
        now[0] += 0.09  # the data pipeline, callbacks: between the last step's end and this one's begin
        began = now[0]
        now[0] += 0.01  # the step
        rates.append(pace.step_ended(64, began))
    assert rates[0] == pytest.approx(64 / 0.01)  # the first step: timed from its begin, nothing before it known
    assert rates[1:] == [pytest.approx(640.0), pytest.approx(640.0)]
