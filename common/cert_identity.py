"""Whom a cluster certificate names (daemon/certs.py makes them), read by both sides of a TLS link: the
coordinator admits agents and operators by it, an agent admits the peers that fetch its snapshots by it.

A node's certificate says CN=NAME and the SAN URI `trainerd://node/NAME`; an operator's carries
`trainerd://operator/NAME`, or `trainerd://operator-readonly/NAME` for one that may only look.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from dataclasses import dataclass

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from proto.vocabulary import NODE_NAME_PATTERN

URI_SCHEME = "trainerd"
# A node serves its peers under NAME.node.trainerd, never under its bare name: a node called "localhost"
# or like the coordinator's host would otherwise pass for the coordinator with its node certificate.
NODE_SERVER_DOMAIN = "node.trainerd"
# Every coordinator certificate carries this DNS name, and no other certificate of the cluster's does (a node's
# names NAME.node.trainerd, an operator's no host): the embedded etcd admits a client by it, so that the CA that
# signs agents' and operators' certificates does not let them into the store behind the coordinator's back.
COORDINATOR_CLIENT_NAME = "coordinator.trainerd"


class CertificateError(Exception):
    """A certificate or key cannot be made, written, read or trusted; the message is one line naming it."""


class PeerKind(str, enum.Enum):
    NODE = "node"
    OPERATOR = "operator"


@dataclass(frozen=True)
class PeerIdentity:
    """Who a verified client certificate speaks for."""

    kind: PeerKind
    name: str
    read_only: bool = False

    @property
    def uri(self) -> str:
        role = "operator-readonly" if self.read_only else self.kind.value
        return f"{URI_SCHEME}://{role}/{self.name}"


def peer_identity(certificate: bytes | str) -> PeerIdentity:
    """Who a client certificate (PEM or DER) speaks for, from its one `trainerd://` SAN URI, which must agree
    with its CN; raises CertificateError otherwise. Checks no signature: call it only on a certificate the TLS
    layer verified against the cluster's CA.
    """
    parsed = _parse(certificate)
    subject = f"{parsed.subject.rfc4514_string()!r:.120}"  # quoted: a hostile subject may hold a newline
    try:
        usages = parsed.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        uris = parsed.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier
        )
    except x509.ExtensionNotFound as exc:
        raise CertificateError(f"certificate {subject} is not a trainerd client certificate: {exc}") from exc
    if ExtendedKeyUsageOID.CLIENT_AUTH not in usages:
        raise CertificateError(f"certificate {subject} is not for client authentication")
    ours = [uri for uri in uris if uri.startswith(f"{URI_SCHEME}://")]
    if len(ours) != 1:
        raise CertificateError(f"certificate {subject} names {len(ours)} trainerd identities, not one")
    match = re.fullmatch(rf"{URI_SCHEME}://(node|operator|operator-readonly)/(.+)", ours[0])
    if match is None or not re.fullmatch(NODE_NAME_PATTERN, match.group(2)):
        raise CertificateError(f"certificate {subject}: {ours[0]!r:.120} is not a trainerd identity")
    role, name = match.groups()
    common_names = [a.value for a in parsed.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if common_names != [name]:
        raise CertificateError(f"certificate {subject}: its CN does not match its identity {ours[0]}")
    kind = PeerKind.NODE if role == "node" else PeerKind.OPERATOR
    return PeerIdentity(kind, name, read_only=role == "operator-readonly")


def serial_of(certificate: bytes | str) -> str:
    """The certificate's serial number in lower-case hex: how the revocation list names it."""
    return format(_parse(certificate).serial_number, "x")


def node_server_name(node: str) -> str:
    """The DNS name a node's certificate serves under, and the name its peers check."""
    return f"{node.lower()}.{NODE_SERVER_DOMAIN}"


def serves_as_node(certificate: bytes | str) -> bool:
    """Whether a node certificate can also serve its peers: serverAuth and the DNS SAN
    `node_server_name(NAME)`, which node certificates made before the agents served one another lack."""
    try:
        identity = peer_identity(certificate)
        parsed = _parse(certificate)
        usages = parsed.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        names = parsed.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName)
    except (CertificateError, x509.ExtensionNotFound):
        return False
    return (identity.kind is PeerKind.NODE and ExtendedKeyUsageOID.SERVER_AUTH in usages
            and node_server_name(identity.name) in names)


def dials_embedded_etcd(certificate: bytes | str) -> bool:
    """Whether a coordinator certificate can be presented to the embedded etcd: clientAuth and the DNS SAN
    COORDINATOR_CLIENT_NAME, which coordinator certificates made before the embedded etcd served TLS lack."""
    try:
        usages = _parse(certificate).extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except (CertificateError, x509.ExtensionNotFound):
        return False
    return ExtendedKeyUsageOID.CLIENT_AUTH in usages and names_host(certificate, COORDINATOR_CLIENT_NAME)


def names_host(certificate: bytes | str, host: str) -> bool:
    """Whether the certificate's subject alternative names include `host`, an IP address or a DNS name: the
    address clients that dial `host` check it against."""
    try:
        names = _parse(certificate).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (CertificateError, x509.ExtensionNotFound):
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        dns_names = {name.lower().rstrip(".") for name in names.get_values_for_type(x509.DNSName)}
        return host.lower().rstrip(".") in dns_names
    return address in names.get_values_for_type(x509.IPAddress)


def _parse(certificate: bytes | str) -> x509.Certificate:
    data = certificate.encode() if isinstance(certificate, str) else certificate
    try:
        return (x509.load_pem_x509_certificate(data) if data.lstrip().startswith(b"-----BEGIN")
                else x509.load_der_x509_certificate(data))
    except ValueError as exc:
        raise CertificateError(f"the peer's certificate cannot be parsed: {exc}") from exc
