"""Retention of MindFormers' Checkpoint 2.0 iterations across generations (trainer/integrations/mindformers/
retention.py): MindFormers removes only what its own process saved, so a restarted job's directory grew by
up to `save_max` iterations a generation. Pure: directories only, no MindFormers."""

from __future__ import annotations

import os
from pathlib import Path

from trainer.integrations.mindformers.retention import prune_earlier_iterations


def iterations(root: Path, *numbers: int) -> None:
    for number in numbers:
        (root / f"iteration_{number:08d}").mkdir(parents=True)
        (root / f"iteration_{number:08d}" / "CKP-model-0000000-0000001.safetensors").write_bytes(b"x")


def left(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_each_commit_removes_an_earlier_generations_iteration_once_keep_newer_ones_exist(tmp_path: Path) -> None:
    iterations(tmp_path, 100, 200, 300)  # generation 1 (keep 3), killed at step 380; generation 2 resumed at 300
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("300")
    for committed, removed in [(400, [100]), (500, [200]), (600, [300])]:
        iterations(tmp_path, committed)  # generation 2's own save; MindFormers prunes those itself
        assert [p.name for p in prune_earlier_iterations(tmp_path, 3, committed, resumed_from=300)] == [
            f"iteration_{n:08d}" for n in removed]
    assert left(tmp_path) == ["iteration_00000400", "iteration_00000500", "iteration_00000600",
                              "latest_checkpointed_iteration.txt"]


def test_the_iterations_this_process_saves_are_left_to_mindformers(tmp_path: Path) -> None:
    """Removing one MindFormers listed as its own makes its own removal of it fail, which ends the process."""
    iterations(tmp_path, 100, 400, 500, 600, 700)
    assert [p.name for p in prune_earlier_iterations(tmp_path, 1, 700, resumed_from=300)] == ["iteration_00000100"]
    assert left(tmp_path) == ["iteration_00000400", "iteration_00000500", "iteration_00000600", "iteration_00000700"]


def test_a_rollback_keeps_what_the_new_commit_leaves_newest(tmp_path: Path) -> None:
    """Resumed from 200 after a rollback: the abandoned 400-600 are newer than the commit and are not counted, and
    they are later saved again by this process (MindFormers writes the same directories)."""
    iterations(tmp_path, 100, 200, 400, 500, 600)
    iterations(tmp_path, 300)
    assert prune_earlier_iterations(tmp_path, 3, 300, resumed_from=200) == []
    assert prune_earlier_iterations(tmp_path, 2, 300, resumed_from=200) == [tmp_path / "iteration_00000100"]


def test_a_fresh_generation_removes_nothing_and_other_files_are_left_alone(tmp_path: Path) -> None:
    iterations(tmp_path, 4, 8)
    (tmp_path / "iteration_notanumber").mkdir()
    (tmp_path / "iteration_00000001").write_text("a file, not an iteration")
    assert prune_earlier_iterations(tmp_path, 1, 8, resumed_from=0) == []
    assert prune_earlier_iterations(tmp_path, 1, 8, resumed_from=4) == [tmp_path / "iteration_00000004"]
    assert left(tmp_path) == ["iteration_00000001", "iteration_00000008", "iteration_notanumber"]


def test_a_symbolic_link_in_an_iterations_place_is_removed_not_what_it_points_to(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("not trainerd's")
    root = tmp_path / "ckpt"
    iterations(root, 300, 400)
    os.symlink(elsewhere, root / "iteration_00000100")
    assert prune_earlier_iterations(root, 1, 400, resumed_from=300) == [root / "iteration_00000100",
                                                                          root / "iteration_00000300"]
    assert (elsewhere / "precious").read_text() == "not trainerd's"


def test_a_missing_directory_removes_nothing(tmp_path: Path) -> None:
    assert prune_earlier_iterations(tmp_path / "gone", 3, 100, resumed_from=50) == []
