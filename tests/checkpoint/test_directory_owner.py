"""One job's checkpoints per directory (trainer/checkpoint/directory_owner.py), on a real file system."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from trainer.checkpoint.directory_owner import OWNER_FILE, DirectoryOfAnotherJob, claim_for_job


def test_the_first_job_claims_the_directory_and_another_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints" / "lm"
    claim_for_job(root, "lm")  # created
    claim_for_job(root, "lm")  # its own again: every rank of every generation claims
    assert (root / OWNER_FILE).read_text() == "lm\n"
    with pytest.raises(DirectoryOfAnotherJob, match=f"checkpoint directory {root} holds the checkpoints of job 'lm'"):
        claim_for_job(root, "lm2")
    assert sorted(os.listdir(root)) == [OWNER_FILE]  # no temporary file left behind


def test_a_directory_saved_into_before_claims_goes_to_the_first_job_that_saves_there(tmp_path: Path) -> None:
    (tmp_path / "step_00000100").mkdir()
    claim_for_job(tmp_path, "old")
    with pytest.raises(DirectoryOfAnotherJob):
        claim_for_job(tmp_path, "new")


def test_ranks_claiming_at_once_agree_on_one_owner(tmp_path: Path) -> None:
    outcomes: dict[str, str] = {}

    def claim(job: str, rank: int) -> None:
        try:
            claim_for_job(tmp_path, job)
            outcomes[f"{job}/{rank}"] = "claimed"
        except DirectoryOfAnotherJob:
            outcomes[f"{job}/{rank}"] = "refused"

    threads = [threading.Thread(target=claim, args=(job, rank)) for rank in range(8) for job in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    owner = (tmp_path / OWNER_FILE).read_text().strip()
    other = "b" if owner == "a" else "a"
    assert {outcomes[f"{owner}/{rank}"] for rank in range(8)} == {"claimed"}
    assert {outcomes[f"{other}/{rank}"] for rank in range(8)} == {"refused"}


def test_what_cannot_name_a_job_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo, link, big = tmp_path / "fifo", tmp_path / "link", tmp_path / "big"
    for root in (fifo, link, big):
        root.mkdir()
    os.mkfifo(fifo / OWNER_FILE)
    (tmp_path / "elsewhere").write_text("x\n")
    (link / OWNER_FILE).symlink_to(tmp_path / "elsewhere")
    (big / OWNER_FILE).write_text("x" * 2000)
    with pytest.raises(DirectoryOfAnotherJob, match="is not a regular file"):
        claim_for_job(fifo, "x")
    with pytest.raises(DirectoryOfAnotherJob, match="cannot read .*: Too many levels of symbolic links"):
        claim_for_job(link, "x")  # not followed, though it names the job
    with pytest.raises(DirectoryOfAnotherJob, match="is over 1024 bytes"):
        claim_for_job(big, "x")
