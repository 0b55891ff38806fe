"""Fixtures of the agent tests: a real unprivileged user for the `run_as` tests (they run as root, as the
agent does), and real tmpfs mounts for in-memory snapshots."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
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


@pytest.fixture
def mount_tmpfs(tmp_path: Path) -> Iterator[Callable[[str, str], Path]]:
    """Mount a tmpfs of a size ("64m") at tmp_path/NAME; every one mounted is unmounted after the test.

    Snapshots belong on tmpfs, and a peer copy takes only what that file system has to spare
    (`MemorySnapshotDir.room_for_copies`): on tmp_path it would depend on how full this machine's disk is."""
    mounted: list[Path] = []

    def mount(name: str, size: str) -> Path:
        mount_point = tmp_path / name
        mount_point.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "trainerd-test-shm", str(mount_point)],
                       check=True)
        mounted.append(mount_point)
        return mount_point

    try:
        yield mount
    finally:
        for mount_point in mounted:
            subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.fixture
def memory_fs(mount_tmpfs: Callable[[str, str], Path]) -> Path:
    """A 64 MiB tmpfs for the snapshots of the hosts that copy from peers."""
    return mount_tmpfs("memory-fs", "64m")
