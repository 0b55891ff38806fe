"""common.atomic_write: a reader sees the old file or the whole new one, a failed write changes nothing and
leaves nothing behind, and the mode asked for is the mode the file gets, whatever the umask."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.atomic_write import write_atomically


@pytest.fixture
def umask() -> Iterator[None]:
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def test_it_replaces_the_whole_file_by_a_rename(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_atomically(path, b"first")
    first_inode = path.stat().st_ino
    write_atomically(path, b"second")
    assert path.read_bytes() == b"second"
    assert path.stat().st_ino != first_inode  # renamed into place, not rewritten where a reader reads
    assert os.listdir(tmp_path) == ["state.json"]  # no temporary file left behind


@pytest.mark.parametrize("failing", ["write", "fsync", "replace"])
def test_a_failed_write_keeps_the_old_content_and_leaves_no_temporary_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(b"old")

    def fail(*args: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, failing, fail)
    with pytest.raises(OSError, match="Input/output error"):
        write_atomically(path, b"new")
    monkeypatch.undo()
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["state.json"]


@pytest.mark.parametrize("mode", [0o600, 0o644])
def test_the_mode_is_applied_whatever_the_umask(tmp_path: Path, umask: None, mode: int) -> None:
    path = tmp_path / "key.pem"
    path.write_bytes(b"old")
    path.chmod(0o666)  # the mode of the file it replaces does not carry over
    write_atomically(path, b"secret", mode)
    assert stat.S_IMODE(path.stat().st_mode) == mode


def test_without_a_mode_the_umask_decides_as_for_open(tmp_path: Path, umask: None) -> None:
    path = tmp_path / "plain.json"
    write_atomically(path, b"{}")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # 0o666 less the umask 0o077


def test_a_link_at_the_path_is_replaced_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"untouched")
    path = tmp_path / "state.json"
    path.symlink_to(elsewhere)
    write_atomically(path, b"new")
    assert not path.is_symlink() and path.read_bytes() == b"new"
    assert elsewhere.read_bytes() == b"untouched"
