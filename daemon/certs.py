"""The cluster's certificates: a private CA, the coordinator's server certificate, and client certificates
that say who a peer is (docs/security.md).

A node's identity is its certificate: CN=NAME and the SAN URI `trainerd://node/NAME`; an agent may speak
only for that node. An operator's certificate carries `trainerd://operator/NAME`, or
`trainerd://operator-readonly/NAME` for one that may only look. `common.cert_identity.peer_identity` reads
that back from the certificate of a peer the TLS layer has already verified against the CA; the servicer
finds the peer's PEM in `context.auth_context()["x509_pem_cert"][0]`. A node's certificate also serves
(serverAuth, DNS SAN NAME.node.trainerd, a name no coordinator address can take): an agent serves its
snapshots to its peers with it, and they check it with `grpc.ssl_target_name_override` set to that name.

Keys are ECDSA P-256. Files are created, never overwritten unless asked (`force`): keys with mode 0600,
certificates 0644. Everything cryptographic is the `cryptography` package's.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.cert_identity import (
    COORDINATOR_CLIENT_NAME,
    CertificateError,
    PeerIdentity,
    PeerKind,
    node_server_name,
)
from proto.vocabulary import NODE_NAME_PATTERN

CA_CERT, CA_KEY = "ca.crt", "ca.key"
COORDINATOR_CERT, COORDINATOR_KEY = "coordinator.crt", "coordinator.key"
# Names a node or operator certificate may not take: its files would replace the CA's or the coordinator's.
RESERVED_NAMES = frozenset({"ca", "coordinator"})

CA_VALIDITY = datetime.timedelta(days=3650)
LEAF_VALIDITY = datetime.timedelta(days=825)
# Certificates are valid from a little before they are made, so a host whose clock is behind accepts them.
_BACKDATE = datetime.timedelta(hours=1)
_MAX_HOST_NAME = 253
_DNS_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_ALWAYS_SERVED = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class Issued:
    """A certificate and its private key."""

    certificate: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    def certificate_pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )


def check_name(name: str, what: str) -> str:
    """`name` when it is a valid node or operator name (NODE_NAME_PATTERN, whole string) and not reserved."""
    if not re.fullmatch(NODE_NAME_PATTERN, name):
        raise CertificateError(
            f"{what} name {name!r:.80} is not valid: 1-63 letters, digits, '_', '.' or '-', starting with a letter "
            "or digit"
        )
    if name in RESERVED_NAMES:
        raise CertificateError(f"{what} name {name!r} is reserved for the {name} files")
    return name


def make_ca(now: datetime.datetime | None = None) -> Issued:
    """A self-signed CA that signs only end-entity certificates (CA:TRUE, pathlen 0), valid for 10 years."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "trainerd CA")])
    start = _now(now) - _BACKDATE
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(certificate, key)


def make_server_certificate(ca: Issued, hosts: Sequence[str], now: datetime.datetime | None = None) -> Issued:
    """The coordinator's certificate (serverAuth) for `hosts` (DNS names or IP addresses), localhost and
    127.0.0.1 always among them. The embedded etcd serves it too, and admits the coordinators by it
    (clientAuth and the name COORDINATOR_CLIENT_NAME): one certificate for every coordinator of the cluster,
    made where the CA's key is, so that no trainerd needs that key.
    """
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys((*_ALWAYS_SERVED, *hosts, COORDINATOR_CLIENT_NAME)):
        name = _host_name(host)
        if name not in names:
            names.append(name)
    return _issue(ca, "trainerd coordinator", names,
                  [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH], now)


def make_node_certificate(ca: Issued, name: str, now: datetime.datetime | None = None) -> Issued:
    """A node agent's certificate: CN=name, SAN URI trainerd://node/name for its client side, and serverAuth
    with the DNS SAN name.node.trainerd for the snapshots it serves its peers."""
    identity = PeerIdentity(PeerKind.NODE, check_name(name, "node"))
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.uri),
                                     x509.DNSName(node_server_name(name))]
    return _issue(ca, name, names, [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH], now)


def sign_node_request(ca: Issued, name: str, request_pem: bytes, validity: datetime.timedelta,
                      now: datetime.datetime | None = None) -> x509.Certificate:
    """The node certificate of `name` (as `make_node_certificate` makes it) for the key of a certificate
    signing request: a joining or renewing agent keeps its key to itself. Whatever else the request asks
    for is ignored; CertificateError when it is not a P-256 request its own key signed."""
    check_name(name, "node")
    try:
        request = x509.load_pem_x509_csr(request_pem)
    except ValueError as exc:
        raise CertificateError(f"the certificate signing request cannot be parsed: {exc}") from None
    public_key = request.public_key()
    if not request.is_signature_valid:
        raise CertificateError("the certificate signing request is not signed by its own key")
    if not isinstance(public_key, ec.EllipticCurvePublicKey) or not isinstance(public_key.curve, ec.SECP256R1):
        raise CertificateError("the certificate signing request's key is not an ECDSA P-256 key")
    identity = PeerIdentity(PeerKind.NODE, name)
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.uri),
                                     x509.DNSName(node_server_name(name))]
    return _sign(ca, name, names, [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH], now,
                 public_key, validity)


def make_operator_certificate(
    ca: Issued, name: str, read_only: bool, now: datetime.datetime | None = None
) -> Issued:
    """An operator's client certificate: CN=name, SAN URI trainerd://operator/name, or
    trainerd://operator-readonly/name when it may only look.
    """
    identity = PeerIdentity(PeerKind.OPERATOR, check_name(name, "operator"), read_only)
    return _issue(ca, name, [x509.UniformResourceIdentifier(identity.uri)], [ExtendedKeyUsageOID.CLIENT_AUTH], now)


def write_issued(issued: Issued, directory: Path, stem: str, force: bool) -> tuple[Path, Path]:
    """Writes `stem.crt` (0644) and `stem.key` (0600) into `directory`; refuses existing files unless `force`.
    Checks both names before writing either.
    """
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    if not force:
        refuse_existing([cert_path, key_path])
    _write_new(key_path, issued.key_pem(), 0o600, force)
    _write_new(cert_path, issued.certificate_pem(), 0o644, force)
    return cert_path, key_path


def refuse_existing(paths: Sequence[Path]) -> None:
    for path in paths:
        if os.path.lexists(path):
            raise CertificateError(f"{path} already exists (pass --force to replace it)")


def load_ca(directory: Path) -> Issued:
    """The CA that `trainerd certs init` wrote into `directory`; CertificateError when missing or mismatched."""
    return load_ca_files(directory / CA_CERT, directory / CA_KEY,
                         f"run `trainerd certs init --dir {directory}` first")


def load_ca_files(cert_path: Path, key_path: Path, if_missing: str) -> Issued:
    """The CA certificate and its key from their files; CertificateError (saying `if_missing` when a file is
    missing) when they cannot be read or do not belong together."""
    try:
        certificate = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except FileNotFoundError as exc:
        raise CertificateError(f"{exc.filename} is missing: {if_missing}") from exc
    except OSError as exc:
        raise CertificateError(f"{exc.filename} cannot be read: {exc.strerror}") from exc
    except (ValueError, TypeError) as exc:
        raise CertificateError(f"the CA in {cert_path} and {key_path} cannot be loaded: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != certificate.public_key():
        raise CertificateError(f"{key_path} is not the key of {cert_path}")
    return Issued(certificate, key)


def _issue(
    ca: Issued, common_name: str, names: list[x509.GeneralName], usages: list[x509.ObjectIdentifier],
    now: datetime.datetime | None,
) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    return Issued(_sign(ca, common_name, names, usages, now, key.public_key(), LEAF_VALIDITY), key)


def _sign(
    ca: Issued, common_name: str, names: list[x509.GeneralName], usages: list[x509.ObjectIdentifier],
    now: datetime.datetime | None, public_key: ec.EllipticCurvePublicKey, validity: datetime.timedelta,
) -> x509.Certificate:
    start = _now(now) - _BACKDATE
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca.certificate.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(min(start + validity, ca.certificate.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=False, crl_sign=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False
        )
        .sign(ca.key, hashes.SHA256())
    )


def _host_name(host: str) -> x509.GeneralName:
    """An IP address SAN for an address, a DNS name SAN for a valid host name; CertificateError otherwise."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host.split(".")
    if len(host) > _MAX_HOST_NAME or not all(_DNS_LABEL.fullmatch(label) for label in labels):
        raise CertificateError(f"host {host!r:.80} is neither an IP address nor a valid DNS name")
    return x509.DNSName(host.lower())


def _write_new(path: Path, data: bytes, mode: int, force: bool) -> None:
    """Creates `path` with exactly `mode` (O_EXCL: never through a link, never over a file unless `force`
    removed it first) and writes `data`.
    """
    if force and os.path.lexists(path) and not os.path.isdir(path):
        path.unlink()
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, mode)
    except FileExistsError as exc:
        problem = "is a directory" if os.path.isdir(path) else "already exists (pass --force to replace it)"
        raise CertificateError(f"{path} {problem}") from exc
    except OSError as exc:
        raise CertificateError(f"{path} cannot be created: {exc.strerror}") from exc
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)  # whatever the umask
        f.write(data)


def _now(now: datetime.datetime | None) -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc) if now is None else now
