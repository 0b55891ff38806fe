"""Joining a cluster with a token (`trainerd-agent --join TOKEN --join-address HOST:PORT --ca-hash sha256:HEX`),
and renewing the node certificate later over the session.

The agent makes its key here (mode 0600, never sent), asks the coordinator's Bootstrap service to sign a
request for it, and keeps the three files a TLS agent needs: under its `tls` paths, or under
`work_dir/tls` when those are unset. Later starts find them there and join nothing.

It has no CA yet, so it trusts the coordinator by the pin alone, before anything secret is sent: it takes
the certificate the join listener presents without checking it, then calls GetAuthority over TLS that
trusts that one certificate (the server must hold its key), and goes on only when the CA it is handed
hashes to the pin, signed that certificate, and that certificate is a coordinator's (it names localhost, as
`trainerd certs` makes every coordinator's and no node's). Only then is the token sent, on the same
connection.
"""

from __future__ import annotations

import datetime
import logging
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from common.atomic_write import write_atomically
from common.ca_pin import ca_pin
from common.cert_identity import PeerKind, names_host, peer_identity, serial_of
from common.config_file import ConfigError, parse_host_port
from common.tls_files import TlsFiles, TlsSettings
from proto import trainerd_pb2 as pb
from proto import trainerd_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 15.0
# Every coordinator certificate names it (daemon/certs.py); the join channel checks the name against it.
COORDINATOR_NAME = "localhost"
# A node certificate is renewed once less than this share of its validity is left.
RENEW_WHEN_LEFT = 1 / 3


class JoinFailed(Exception):
    """Joining did not give this host a certificate; the message is one line saying why."""


def stored_tls(work_dir: Path) -> TlsSettings:
    """Where a joined agent keeps its files when its `tls` names none."""
    directory = work_dir / "tls"
    return TlsSettings(ca_file=str(directory / "ca.crt"), cert_file=str(directory / "node.crt"),
                       key_file=str(directory / "node.key"))


def has_stored_files(settings: TlsSettings) -> bool:
    return all(os.path.exists(path) for path in (settings.ca_file, settings.cert_file, settings.key_file))


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def signing_request(key: ec.EllipticCurvePrivateKey, node_name: str) -> bytes:
    request = (x509.CertificateSigningRequestBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_name)]))
               .sign(key, hashes.SHA256()))
    return request.public_bytes(serialization.Encoding.PEM)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def check_node_certificate(certificate_pem: bytes, ca_pem: bytes, key: ec.EllipticCurvePrivateKey,
                           node_name: str) -> None:
    """JoinFailed unless the certificate is node `node_name`'s, of this CA, for this key."""
    try:
        certificate = x509.load_pem_x509_certificate(certificate_pem)
        certificate.verify_directly_issued_by(x509.load_pem_x509_certificate(ca_pem))
        identity = peer_identity(certificate_pem)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise JoinFailed(f"the coordinator sent a certificate that is not of the cluster's CA: {exc}") from None
    if identity.kind is not PeerKind.NODE or identity.name != node_name:
        raise JoinFailed(f"the coordinator sent a certificate for {identity.kind.value} {identity.name}, not node "
                         f"{node_name}")
    if certificate.public_key() != key.public_key():
        raise JoinFailed("the coordinator sent a certificate for another key")


def write_private(path: Path, data: bytes, mode: int) -> None:
    """Writes `path` whole with `mode` (whatever the umask), replacing it at once: a crash leaves the old
    file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_atomically(path, data, mode)


@dataclass(frozen=True)
class Joined:
    ca_pem: bytes
    certificate_pem: bytes


def join(join_address: str, token: str, node_name: str, pin: str, settings: TlsSettings) -> Joined:
    """Make a key, have the coordinator sign it for `node_name`, and write the key, the certificate and the
    CA where `settings` says. JoinFailed (one line) when the coordinator cannot be reached or trusted, or
    refuses the token."""
    host, port = parse_host_port(join_address)
    try:
        presented = ssl.get_server_certificate((host, port), timeout=JOIN_TIMEOUT_S).encode()
    except (OSError, ssl.SSLError) as exc:
        raise JoinFailed(f"cannot reach the join listener at {join_address}: {exc}") from None
    key = new_key()
    options = [("grpc.ssl_target_name_override", COORDINATOR_NAME)]
    credentials = grpc.ssl_channel_credentials(root_certificates=presented)
    with grpc.secure_channel(join_address, credentials, options=options) as channel:
        stub = pb_grpc.BootstrapStub(channel)
        try:
            ca_pem = stub.GetAuthority(pb.AuthorityRequest(), timeout=JOIN_TIMEOUT_S).ca_pem
        except grpc.RpcError as exc:
            raise JoinFailed(f"{join_address} did not name its CA: {exc.code().name} {exc.details()}") from None
        _trust(presented, ca_pem, pin, join_address)
        write_private(Path(settings.key_file), key_pem(key), 0o600)
        try:
            reply = stub.Join(pb.JoinRequest(token=token, node_name=node_name,
                                             csr_pem=signing_request(key, node_name)), timeout=JOIN_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise JoinFailed(f"the coordinator at {join_address} refused to join node {node_name}: "
                             f"{exc.details() or exc.code().name}") from None
    check_node_certificate(reply.certificate_pem, ca_pem, key, node_name)
    write_private(Path(settings.ca_file), ca_pem, 0o644)
    write_private(Path(settings.cert_file), reply.certificate_pem, 0o644)
    return Joined(ca_pem, reply.certificate_pem)


def _trust(presented_pem: bytes, ca_pem: bytes, pin: str, join_address: str) -> None:
    """JoinFailed unless `ca_pem` is the pinned CA and the certificate the listener proved it holds is a
    coordinator's of that CA."""
    try:
        got = ca_pin(ca_pem)
    except ValueError:
        raise JoinFailed(f"{join_address} named no CA certificate") from None
    if got != pin:
        raise JoinFailed(f"{join_address} is not a coordinator of the pinned cluster: its CA hashes to {got}, not "
                         f"{pin}")
    try:
        x509.load_pem_x509_certificate(presented_pem).verify_directly_issued_by(
            x509.load_pem_x509_certificate(ca_pem))
    except (ValueError, TypeError, InvalidSignature):
        raise JoinFailed(f"{join_address} presents a certificate the pinned CA did not sign") from None
    if not names_host(presented_pem, COORDINATOR_NAME):
        raise JoinFailed(f"{join_address} presents a certificate of the CA that is not a coordinator's")


def renewal_due(certificate_pem: bytes, now: datetime.datetime) -> bool:
    """Whether less than RENEW_WHEN_LEFT of the certificate's validity is left. Pure."""
    certificate = x509.load_pem_x509_certificate(certificate_pem)
    start, end = certificate.not_valid_before_utc, certificate.not_valid_after_utc
    return end - now < (end - start) * RENEW_WHEN_LEFT


def check_join_options(token: str | None, join_address: str | None, pin: str | None) -> None:
    """ConfigError unless --join, --join-address and --ca-hash come together."""
    given = {"--join": token, "--join-address": join_address, "--ca-hash": pin}
    if any(given.values()) and not all(given.values()):
        missing = ", ".join(name for name, value in given.items() if not value)
        raise ConfigError(f"trainerd-agent: joining needs --join, --join-address and --ca-hash together: {missing} "
                          f"missing (trainerctl tokens create prints the whole command)")


class Renewal:
    """Renews this node's certificate over its session (RenewCertificate, answered with NodeCertificate)
    once `renewal_due`: a new key each time, kept (0600) with the certificate in the files `settings`
    names; `renewed(files)` then gives the agent the new files for its next dial."""

    def __init__(self, settings: TlsSettings, node_name: str, send: Callable[[pb.AgentMessage], None],
                 renewed: Callable[[TlsFiles], None]) -> None:
        self._settings = settings
        self._node_name = node_name
        self._send = send
        self._renewed = renewed
        self._pending: ec.EllipticCurvePrivateKey | None = None

    def check(self, now: datetime.datetime) -> None:
        """Ask for a new certificate when it is due (once: a request unanswered is asked again only after
        `forget_request`, at the next session)."""
        if self._pending is not None:
            return
        if not renewal_due(Path(self._settings.cert_file).read_bytes(), now):
            return
        self._pending = new_key()
        log.info("this node's certificate expires soon; asking the coordinator for a new one")
        self._send(pb.AgentMessage(renew_certificate=pb.RenewCertificate(
            csr_pem=signing_request(self._pending, self._node_name))))

    def forget_request(self) -> None:
        """The session ended: an answer to a request made on it will not come."""
        self._pending = None

    def received(self, certificate_pem: bytes) -> None:
        key, self._pending = self._pending, None
        if key is None:
            log.warning("ignoring a node certificate this agent did not ask for")
            return
        ca_pem = Path(self._settings.ca_file).read_bytes()
        try:
            check_node_certificate(certificate_pem, ca_pem, key, self._node_name)
        except JoinFailed as exc:
            log.warning("the renewed certificate is not usable: %s", exc)
            return
        write_private(Path(self._settings.key_file), key_pem(key), 0o600)
        write_private(Path(self._settings.cert_file), certificate_pem, 0o644)
        expires = x509.load_pem_x509_certificate(certificate_pem).not_valid_after_utc
        log.info("renewed this node's certificate (serial %s, valid until %s); the next dial presents it",
                 serial_of(certificate_pem), expires.isoformat(timespec="seconds"))
        self._renewed(TlsFiles(ca_pem, certificate_pem, key_pem(key)))

