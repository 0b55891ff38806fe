"""A real unprivileged user for the `run_as` tests (they run as root, as the agent does)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.config import RunAsSettings
from agent.worker_user import WorkerUser

WORKER_HOME = "/nonexistent"


@pytest.fixture(scope="session")
def worker_user() -> Iterator[WorkerUser]:
    """A system user with a group of its own, made for this test run and removed after it."""
    name = f"trainerd-test-{os.getpid()}"
    subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", WORKER_HOME,
                    "--shell", "/usr/sbin/nologin", name], check=True, capture_output=True)
    try:
        yield WorkerUser.from_settings(RunAsSettings(user=name))
    finally:
        subprocess.run(["userdel", name], check=True, capture_output=True)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user can reach (pytest's tmp_path is inside a directory only root may enter)."""
    path = Path(tempfile.mkdtemp(prefix="trainerd-run-as-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)
