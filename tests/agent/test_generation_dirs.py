"""An agent keeps the files of its newest generations only: a long job's restarts do not fill its disk."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from agent.generation_dirs import KEPT_GENERATIONS, claim_generation_dir, generation_dir, prune_generation_dirs
from tests.agent.supervisor_fakes import Host, launch, run


def make_generations(work_dir: Path, generations: range) -> None:
    for generation in generations:
        directory = generation_dir(work_dir, generation)
        directory.mkdir(parents=True)
        (directory / "rank0.log").write_text(f"generation {generation}\n")


def kept(work_dir: Path) -> list[str]:
    return sorted(entry.name for entry in (work_dir / "generations").iterdir())


def test_only_the_newest_generations_are_kept(tmp_path: Path) -> None:
    make_generations(tmp_path, range(1, 11))
    assert prune_generation_dirs(tmp_path, current=10, keep=3) == [1, 2, 3, 4, 5, 6, 7]
    assert kept(tmp_path) == ["000008", "000009", "000010"]
    assert (generation_dir(tmp_path, 10) / "rank0.log").read_text() == "generation 10\n"
    assert prune_generation_dirs(tmp_path, current=10, keep=3) == []


def test_the_current_and_newer_generations_and_foreign_entries_stay(tmp_path: Path) -> None:
    make_generations(tmp_path, range(1, 6))
    elsewhere = tmp_path / "elsewhere"
    make_generations(elsewhere, range(1, 2))
    root = tmp_path / "generations"
    (root / "notes").mkdir()
    (root / "000000042.txt").write_text("not a generation")
    os.symlink(generation_dir(elsewhere, 1), root / "000000")
    assert prune_generation_dirs(tmp_path, current=2, keep=1) == [1]
    assert kept(tmp_path) == ["000000", "000000042.txt", "000002", "000003", "000004", "000005", "notes"]
    assert (generation_dir(elsewhere, 1) / "rank0.log").exists()


def test_a_work_dir_without_generations_is_fine(tmp_path: Path) -> None:
    assert prune_generation_dirs(tmp_path, current=1) == []


def test_a_launch_removes_the_files_of_generations_past_the_kept_number(tmp_path: Path) -> None:
    make_generations(tmp_path, range(1, KEPT_GENERATIONS + 2))

    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(KEPT_GENERATIONS + 2))

    run(scenario())
    names = kept(tmp_path)
    assert len(names) == KEPT_GENERATIONS and names[0] == "000003" and names[-1] == f"{KEPT_GENERATIONS + 2:06d}"


def test_a_generation_directory_another_job_left_is_emptied_before_this_job_uses_it(tmp_path: Path) -> None:
    old = claim_generation_dir(tmp_path, 1, "old-name")
    (old / "rank0.log").write_text("the old job's training\n")
    same = claim_generation_dir(tmp_path, 1, "old-name")  # the same job's generation again: kept
    assert (same / "rank0.log").read_text() == "the old job's training\n"
    renamed = claim_generation_dir(tmp_path, 1, "new-name")
    assert sorted(p.name for p in renamed.iterdir()) == ["job"] and (renamed / "job").read_text() == "new-name"
    legacy = generation_dir(tmp_path, 2)
    legacy.mkdir()
    (legacy / "rank0.log").write_text("written before the job file existed\n")
    assert (claim_generation_dir(tmp_path, 2, "new-name") / "rank0.log").exists()


def test_a_job_under_a_new_name_is_launched_from_generation_1_with_logs_of_its_own(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        await host.supervisor.launch(launch(2))
        of_generation_2 = host.launcher.started["rank0"]
        renamed = replace(launch(1), job_name="renamed")
        await host.supervisor.launch(renamed)
        of_renamed = host.launcher.started["rank0"]
        assert of_renamed is not of_generation_2 and not of_generation_2.running
        assert of_renamed.log_path.parent == generation_dir(tmp_path, 1) and host.supervisor.generation == 1
        await host.supervisor.launch(renamed)  # a repeat of the new job's launch is still ignored
        assert host.launcher.started["rank0"] is of_renamed and of_renamed.running

    run(scenario())
    assert sorted(p.name for p in generation_dir(tmp_path, 1).iterdir() if p.suffix == ".log") == [
        "rank0.log", "rank1.log", "scheduler.log"]
    assert (generation_dir(tmp_path, 1) / "job").read_text() == "renamed"
