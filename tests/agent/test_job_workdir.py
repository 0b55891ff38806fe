"""The paths a Launch names: the job's working directory and the graceful-exit file inside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.job_workdir import UnsafeJobPath, graceful_exit_path, job_workdir


def test_the_default_workdir_is_per_job_under_the_agent_work_dir(tmp_path: Path) -> None:
    assert job_workdir(tmp_path, "user-script_1.0", "") == tmp_path / "jobs" / "user-script_1.0"


def test_a_named_workdir_is_used_normalised(tmp_path: Path) -> None:
    assert job_workdir(tmp_path, "job", "/data/runs//mnist/") == Path("/data/runs/mnist")


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../x", "job\n", "job\x00", "job name", "j" * 256])
def test_a_job_name_that_is_not_one_plain_directory_name_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(UnsafeJobPath, match="job name"):
        job_workdir(tmp_path, name, "")


@pytest.mark.parametrize("workdir, reason", [
    ("runs/mnist", "not an absolute path"),
    ("/", "root directory"),
    ("//", "root directory"),
    ("/data/../etc", "climbs out"),
    ("/data/run\n[ERROR] forged", "control characters"),
    ("/data/\x00run", "control characters"),
])
def test_an_unsafe_workdir_is_refused_with_its_reason(tmp_path: Path, workdir: str, reason: str) -> None:
    with pytest.raises(UnsafeJobPath, match=reason):
        job_workdir(tmp_path, "job", workdir)


def test_the_graceful_exit_file_is_inside_the_workdir(tmp_path: Path) -> None:
    assert graceful_exit_path(tmp_path, "exit.json") == tmp_path.resolve() / "exit.json"
    assert graceful_exit_path(tmp_path, "config/exit.json") == tmp_path.resolve() / "config" / "exit.json"


@pytest.mark.parametrize("name", ["../exit.json", "/etc/exit.json", "a/../../exit.json", ".", "", "exit\n.json",
                                  "link/exit.json"])
def test_a_graceful_exit_file_that_leads_out_of_the_workdir_is_refused(tmp_path: Path, name: str) -> None:
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    (workdir / "link").symlink_to(tmp_path)  # inside by name, outside in fact
    with pytest.raises(UnsafeJobPath, match="graceful_exit_file"):
        graceful_exit_path(workdir, name)
