"""When a worker saves: every N steps and at the step the agent's control file asks for, decided alike on
every rank; a hostile or broken control file is skipped with a warning, never a crash."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from common.atomic_write import write_atomically
from proto.worker_files import MAX_CONTROL_BYTES, ControlFileRequest, encode_control
from trainer.runtime.checkpoint_schedule import CheckpointSchedule, ControlFile

GENERATION = 4


def write_control(path: Path, body: ControlFileRequest | str) -> None:
    """As the agent does (a request), or as something broken might (any text)."""
    write_atomically(path, body.encode() if isinstance(body, str) else encode_control(body))


def request(step: int, generation: int = GENERATION) -> ControlFileRequest:
    return ControlFileRequest(generation, step)


def schedule(tmp_path: Path, every: int = 0) -> CheckpointSchedule:
    return CheckpointSchedule(every, GENERATION, ControlFile(tmp_path / "control.json"), "job llm rank 0")


def saved_steps(plan: CheckpointSchedule, steps: range) -> list[int]:
    return [step for step in steps if plan.due(step)]


def test_periodic_saves_follow_global_step_numbers() -> None:
    plan = CheckpointSchedule(10, GENERATION, None, "job llm rank 0")
    assert saved_steps(plan, range(1, 36)) == [10, 20, 30]
    assert saved_steps(plan, range(41, 61)) == [50, 60]  # resumed after step 40: the same rhythm
    assert saved_steps(CheckpointSchedule(0, GENERATION, None, "x"), range(1, 100)) == []


def test_a_requested_step_is_saved_once_it_completes(tmp_path: Path) -> None:
    plan = schedule(tmp_path, every=10)
    assert saved_steps(plan, range(1, 4)) == []
    write_control(tmp_path / "control.json", request(7))
    assert saved_steps(plan, range(4, 25)) == [7, 10, 20]
    assert plan.requested is None


def test_a_new_request_replaces_a_pending_one(tmp_path: Path) -> None:
    plan = schedule(tmp_path)
    write_control(tmp_path / "control.json", request(9))
    assert not plan.due(1)
    write_control(tmp_path / "control.json", request(5))
    assert saved_steps(plan, range(2, 12)) == [5]


def test_a_request_for_a_completed_step_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plan = schedule(tmp_path)
    assert saved_steps(plan, range(1, 6)) == []
    write_control(tmp_path / "control.json", request(6))
    assert not plan.due(6)  # polled after step 6 completed: too late, whatever the other ranks do
    assert saved_steps(plan, range(7, 20)) == []
    assert "the checkpoint requested at step 6 arrived after step 6 had completed; ignored" in caplog.text


def test_a_request_of_another_generation_is_ignored(tmp_path: Path) -> None:
    plan = schedule(tmp_path)
    write_control(tmp_path / "control.json", request(3, generation=GENERATION - 1))
    assert saved_steps(plan, range(1, 10)) == []


def test_the_same_request_rewritten_is_honoured_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An agent that restarts rewrites the file with the request already served: no second save, no warning."""
    plan = schedule(tmp_path)
    write_control(tmp_path / "control.json", request(2))
    assert saved_steps(plan, range(1, 4)) == [2]
    write_control(tmp_path / "control.json", request(2))
    assert saved_steps(plan, range(4, 8)) == []
    assert "WARNING" not in caplog.text


def test_the_file_is_read_only_when_it_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    control = ControlFile(tmp_path / "control.json")
    assert control.poll() is None  # no file yet: no request
    write_control(control.path, request(8))
    assert control.poll() == ControlFileRequest(GENERATION, 8)
    reads: list[object] = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda *a, **k: reads.append(a) or real_open(*a, **k))
    for _ in range(100):
        assert control.poll() is None
    assert reads == []
    write_control(control.path, request(9))
    reads.clear()  # the writer's own open
    assert control.poll() == ControlFileRequest(GENERATION, 9)
    assert len(reads) == 1


def test_a_broken_control_file_is_skipped_with_one_warning_until_it_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plan = schedule(tmp_path)
    path = tmp_path / "control.json"
    write_control(path, "{\"schema\": 1, \"generation\": 4")
    with caplog.at_level(logging.WARNING):
        assert saved_steps(plan, range(1, 5)) == []
    assert caplog.text.count("Ignoring the control file") == 1
    assert "not JSON" in caplog.text
    write_control(path, " " * (MAX_CONTROL_BYTES + 1))
    assert saved_steps(plan, range(5, 8)) == []
    assert f"more than {MAX_CONTROL_BYTES}" in caplog.text
    write_control(path, request(9))
    assert saved_steps(plan, range(8, 12)) == [9]


def test_an_unreadable_control_file_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "control.json"
    path.mkdir()  # stat works, open fails
    plan = schedule(tmp_path)
    assert saved_steps(plan, range(1, 4)) == []
    assert caplog.text.count("Ignoring the control file") == 1
