"""EtcdStore over mutual TLS, against a real etcd that requires client certificates.

The certificates are made for each run with the openssl command-line tool.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.etcd_process import find_etcd_binary
from daemon.store.etcd import EtcdStore
from daemon.store.interface import StoreUnavailable
from tests.ports import free_port
from tests.store.test_contract import k


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _issue(name: str, extensions: str, cwd: Path) -> None:
    """`{name}.pem` and `{name}.key`, signed by the CA in `cwd`."""
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=cwd)
    (cwd / f"{name}.ext").write_text(extensions + "\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "1", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=cwd)


@pytest.fixture
def tls_etcd(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An etcd serving https on 127.0.0.1 that requires a client certificate from our CA;
    yields its endpoint and the folder holding ca.pem, client.pem and client.key."""
    pki = tmp_path / "pki"
    pki.mkdir()
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=trainerd test CA",
             "-addext", "basicConstraints=critical,CA:TRUE", cwd=pki)
    _issue("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth", pki)
    _issue("client", "extendedKeyUsage=clientAuth", pki)

    client_url = f"https://127.0.0.1:{free_port()}"
    peer_url = f"http://127.0.0.1:{free_port()}"
    with open(tmp_path / "etcd.log", "wb") as log:
        etcd = subprocess.Popen([
            find_etcd_binary(), "--name", "tls", "--data-dir", str(tmp_path / "data"),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"tls={peer_url}",
            "--cert-file", str(pki / "server.pem"), "--key-file", str(pki / "server.key"),
            "--trusted-ca-file", str(pki / "ca.pem"), "--client-cert-auth",
        ], stdout=log, stderr=subprocess.STDOUT)
    try:
        yield client_url, pki
    finally:
        etcd.terminate()
        etcd.wait(timeout=10)


def test_mutual_tls_with_the_right_certificates_and_refusal_without_them(
        tls_etcd: tuple[str, Path]) -> None:
    endpoint, pki = tls_etcd

    async def scenario() -> None:
        # connect waits for the endpoint, so it also waits for this etcd to start
        store = await EtcdStore.connect([endpoint], ca_file=str(pki / "ca.pem"),
                                        cert_file=str(pki / "client.pem"),
                                        key_file=str(pki / "client.key"), timeout_s=10)
        try:
            assert await store.compare_and_swap(k("a"), b"1", 0) is not None
            assert (await store.get(k("a"))).value == b"1"
        finally:
            await store.close()

        with pytest.raises(StoreUnavailable):  # no client certificate: the handshake fails
            await EtcdStore.connect([endpoint], ca_file=str(pki / "ca.pem"), timeout_s=1)

    asyncio.run(asyncio.wait_for(scenario(), 30))
