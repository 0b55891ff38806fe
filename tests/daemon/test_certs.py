"""`trainerd certs`: the files it writes, certificates that verify against their CA and no other, the identity
a client certificate carries, and a real mutual-TLS handshake with grpc.aio on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import stat
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from common.cert_identity import (
    COORDINATOR_CLIENT_NAME,
    CertificateError,
    PeerIdentity,
    PeerKind,
    dials_embedded_etcd,
    names_host,
    peer_identity,
    serves_as_node,
)
from daemon.certs import Issued, _issue, make_ca, make_node_certificate, make_operator_certificate
from daemon.cli.trainerd_main import cli


def trainerd(*argv: str) -> str:
    result = CliRunner().invoke(cli, list(argv), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA and coordinator certificate for coord.example and 10.0.0.5, node n1, operators alice and bob
    (read-only), as an administrator makes them.
    """
    directory = tmp_path_factory.mktemp("pki") / "certs"
    trainerd("certs", "init", "--dir", str(directory), "--host", "coord.example", "--host", "10.0.0.5")
    trainerd("certs", "node", "n1", "--dir", str(directory))
    trainerd("certs", "operator", "alice", "--dir", str(directory))
    trainerd("certs", "operator", "bob", "--read-only", "--dir", str(directory))
    return directory


@pytest.fixture(scope="module")
def other_ca_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another cluster's CA, coordinator and node n1: same names, different keys."""
    directory = tmp_path_factory.mktemp("other") / "certs"
    trainerd("certs", "init", "--dir", str(directory))
    trainerd("certs", "node", "n1", "--dir", str(directory))
    return directory


def load(directory: Path, stem: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate((directory / f"{stem}.crt").read_bytes())


def verify_client(ca_dir: Path, leaf: x509.Certificate) -> list[x509.GeneralName]:
    verifier = PolicyBuilder().store(Store([load(ca_dir, "ca")])).build_client_verifier()
    return list(verifier.verify(leaf, []).subjects or [])


def test_init_node_and_operator_write_keys_0600_and_certificates_0644(cert_dir: Path) -> None:
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in cert_dir.iterdir()}
    assert modes == {
        "ca.crt": 0o644, "ca.key": 0o600, "coordinator.crt": 0o644, "coordinator.key": 0o600,
        "n1.crt": 0o644, "n1.key": 0o600, "alice.crt": 0o644, "alice.key": 0o600, "bob.crt": 0o644, "bob.key": 0o600,
    }
    ca = load(cert_dir, "ca")
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert (constraints.critical, constraints.value.ca, constraints.value.path_length) == (True, True, 0)
    assert ca.not_valid_after_utc - ca.not_valid_before_utc >= datetime.timedelta(days=3650)


def test_modes_do_not_depend_on_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o077)
    try:
        trainerd("certs", "init", "--dir", str(tmp_path))
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "coordinator.crt").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "coordinator.key").stat().st_mode) == 0o600


def test_the_coordinator_certificate_serves_its_hosts_localhost_and_127_0_0_1(cert_dir: Path) -> None:
    server = load(cert_dir, "coordinator")
    store = Store([load(cert_dir, "ca")])
    for name in (x509.DNSName("localhost"), x509.DNSName("coord.example"),
                 x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.IPAddress(ipaddress.ip_address("10.0.0.5"))):
        PolicyBuilder().store(store).build_server_verifier(name).verify(server, [])
    with pytest.raises(VerificationError):
        PolicyBuilder().store(store).build_server_verifier(x509.DNSName("elsewhere.example")).verify(server, [])
    usages = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usages) == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]


def test_only_the_coordinator_certificate_may_dial_the_embedded_etcd(cert_dir: Path) -> None:
    """The embedded etcd admits a client of the cluster's CA by the name COORDINATOR_CLIENT_NAME: an agent's or
    an operator's certificate must not carry it, nor a coordinator certificate made before (serverAuth only)."""
    coordinator = (cert_dir / "coordinator.crt").read_bytes()
    assert dials_embedded_etcd(coordinator) and names_host(coordinator, COORDINATOR_CLIENT_NAME)
    for stem in ("n1", "alice", "bob"):
        assert not names_host((cert_dir / f"{stem}.crt").read_bytes(), COORDINATOR_CLIENT_NAME), stem
        assert not dials_embedded_etcd((cert_dir / f"{stem}.crt").read_bytes()), stem
    ca = make_ca()
    serving_only = _issue(ca, "trainerd coordinator", [x509.DNSName(COORDINATOR_CLIENT_NAME)],
                          [ExtendedKeyUsageOID.SERVER_AUTH], None)
    assert not dials_embedded_etcd(serving_only.certificate_pem())


def test_client_certificates_verify_against_their_ca_and_name_their_identity(cert_dir: Path) -> None:
    assert verify_client(cert_dir, load(cert_dir, "n1")) == [x509.UniformResourceIdentifier("trainerd://node/n1"),
                                                             x509.DNSName("n1.node.trainerd")]
    assert verify_client(cert_dir, load(cert_dir, "bob")) == [
        x509.UniformResourceIdentifier("trainerd://operator-readonly/bob")]
    assert peer_identity((cert_dir / "n1.crt").read_bytes()) == PeerIdentity(PeerKind.NODE, "n1", False)
    assert peer_identity((cert_dir / "alice.crt").read_text()) == PeerIdentity(PeerKind.OPERATOR, "alice", False)
    bob_der = load(cert_dir, "bob").public_bytes(serialization.Encoding.DER)
    assert peer_identity(bob_der) == PeerIdentity(PeerKind.OPERATOR, "bob", True)


def test_a_certificate_of_another_ca_does_not_verify(cert_dir: Path, other_ca_dir: Path) -> None:
    impostor = load(other_ca_dir, "n1")
    assert peer_identity((other_ca_dir / "n1.crt").read_bytes()).name == "n1"  # says the same, so only
    with pytest.raises(VerificationError):                                     # verification tells them apart
        verify_client(cert_dir, impostor)
    with pytest.raises(VerificationError):
        PolicyBuilder().store(Store([load(cert_dir, "ca")])).build_server_verifier(
            x509.DNSName("localhost")).verify(load(other_ca_dir, "coordinator"), [])


def hand_made(ca: Issued, common_name: str, uris: list[str], usage: x509.ObjectIdentifier) -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca.certificate.subject).public_key(key.public_key()).serial_number(1)
        .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if uris:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(u) for u in uris]), critical=False)
    return builder.sign(ca.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def test_a_node_certificate_serves_its_name_and_one_made_before_cannot() -> None:
    ca = make_ca()
    node = make_node_certificate(ca, "gpu_07.rack-2")
    usages = node.certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH}
    assert serves_as_node(node.certificate_pem())
    assert peer_identity(node.certificate_pem()) == PeerIdentity(PeerKind.NODE, "gpu_07.rack-2")
    old_style = hand_made(ca, "n1", ["trainerd://node/n1"], ExtendedKeyUsageOID.CLIENT_AUTH)
    assert peer_identity(old_style).name == "n1" and not serves_as_node(old_style)
    assert not serves_as_node(make_operator_certificate(ca, "alice", False).certificate_pem())
    assert not serves_as_node(b"not a certificate")


@pytest.mark.parametrize(("common_name", "uris", "usage", "message"), [
    ("n1", [], ExtendedKeyUsageOID.CLIENT_AUTH, "is not a trainerd client certificate"),
    ("n1", ["trainerd://node/n1"], ExtendedKeyUsageOID.SERVER_AUTH, "is not for client authentication"),
    ("n1", ["trainerd://node/n1", "trainerd://node/n2"], ExtendedKeyUsageOID.CLIENT_AUTH, "names 2 trainerd"),
    ("n2", ["trainerd://node/n1"], ExtendedKeyUsageOID.CLIENT_AUTH, "its CN does not match"),
    ("n1\n", ["trainerd://node/n1\n"], ExtendedKeyUsageOID.CLIENT_AUTH, "is not a trainerd identity"),
    ("n1", ["trainerd://admin/n1"], ExtendedKeyUsageOID.CLIENT_AUTH, "is not a trainerd identity"),
    ("x", ["trainerd://node/../x"], ExtendedKeyUsageOID.CLIENT_AUTH, "is not a trainerd identity"),
])
def test_peer_identity_refuses_certificates_that_do_not_name_one_trainerd_identity(
    common_name: str, uris: list[str], usage: x509.ObjectIdentifier, message: str
) -> None:
    with pytest.raises(CertificateError, match=message) as refused:
        peer_identity(hand_made(make_ca(), common_name, uris, usage))
    assert "\n" not in str(refused.value)


def test_names_are_matched_whole() -> None:
    with pytest.raises(CertificateError, match="node name 'n1\\\\n' is not valid"):
        make_node_certificate(make_ca(), "n1\n")
    with pytest.raises(CertificateError, match="is reserved"):
        make_node_certificate(make_ca(), "coordinator")


def test_existing_files_are_refused_and_force_replaces_them_without_following_links(tmp_path: Path) -> None:
    trainerd("certs", "init", "--dir", str(tmp_path))
    target = tmp_path / "elsewhere"
    target.write_text("not a key")
    (tmp_path / "n1.key").symlink_to(target)
    result = CliRunner().invoke(cli, ["certs", "node", "n1", "--dir", str(tmp_path)])
    assert (result.exit_code, result.output) == (2, f"Error: {tmp_path / 'n1.key'} already exists "
                                                    "(pass --force to replace it)\n")
    assert not (tmp_path / "n1.crt").exists()
    trainerd("certs", "node", "n1", "--dir", str(tmp_path), "--force")
    assert target.read_text() == "not a key"
    assert not (tmp_path / "n1.key").is_symlink()
    assert peer_identity((tmp_path / "n1.crt").read_bytes()).name == "n1"


def _pem(directory: Path, stem: str) -> tuple[bytes, bytes]:
    return (directory / f"{stem}.key").read_bytes(), (directory / f"{stem}.crt").read_bytes()


def test_mutual_tls_with_grpc_aio_admits_only_certificates_of_the_cluster_ca(
    cert_dir: Path, other_ca_dir: Path
) -> None:
    ca = (cert_dir / "ca.crt").read_bytes()
    seen: list[tuple[PeerIdentity, str | None]] = []

    async def who_am_i(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        identity = peer_identity(context.auth_context()["x509_pem_cert"][0])
        seen.append((identity, context.peer_identity_key()))
        return identity.uri.encode()

    async def scenario() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "test.Peer", {"WhoAmI": grpc.unary_unary_rpc_method_handler(who_am_i)}),))
        port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
            [_pem(cert_dir, "coordinator")], root_certificates=ca, require_client_auth=True))
        await server.start()

        async def call(credentials: grpc.ChannelCredentials) -> bytes:
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
                return await channel.unary_unary("/test.Peer/WhoAmI")(b"", timeout=10)

        try:
            assert await call(grpc.ssl_channel_credentials(ca, *_pem(cert_dir, "n1"))) == b"trainerd://node/n1"
            assert await call(grpc.ssl_channel_credentials(ca, *_pem(cert_dir, "bob"))) == \
                b"trainerd://operator-readonly/bob"
            refused = {
                "no client certificate": grpc.ssl_channel_credentials(ca),
                "a client certificate of another CA": grpc.ssl_channel_credentials(ca, *_pem(other_ca_dir, "n1")),
                "a client trusting another CA": grpc.ssl_channel_credentials(
                    (other_ca_dir / "ca.crt").read_bytes(), *_pem(other_ca_dir, "n1")),
            }
            for case, credentials in refused.items():
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await call(credentials)
                assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, case
        finally:
            await server.stop(None)

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert seen == [(PeerIdentity(PeerKind.NODE, "n1"), "x509_subject_alternative_name"),
                    (PeerIdentity(PeerKind.OPERATOR, "bob", True), "x509_subject_alternative_name")]
