"""Joining hosts and revoking them, on the wire: the Bootstrap service a joining agent calls (no client
certificate), what the Control service does for `trainerctl tokens` and `trainerctl nodes revoke`, and what
the Session servicer asks of a node's certificate (daemon/node_authority.py decides).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from common.cert_identity import CertificateError
from daemon.coordinator import AgentSession, Coordinator
from daemon.join_tokens import create_token, delete_token, list_tokens
from daemon.node_authority import JoinRefused, KnownCertificate, NodeAuthority, Revoked, certificate_serial
from daemon.peer_auth import PermissionDenied
from proto import trainerd_pb2 as pb
from proto import trainerd_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# A CSR holds one P-256 key and a name: a few hundred bytes.
MAX_CSR_BYTES = 4096


def presented_certificate(context: grpc.aio.ServicerContext) -> KnownCertificate | None:
    """The serial and expiry of the client certificate of the call (None without TLS)."""
    certificates = context.auth_context().get("x509_pem_cert", [])
    if not certificates:
        return None
    try:
        certificate = x509.load_pem_x509_certificate(certificates[0])
    except ValueError as exc:
        raise PermissionDenied(f"the client's certificate cannot be parsed: {exc}") from None
    return KnownCertificate(certificate_serial(certificate), certificate.not_valid_after_utc.timestamp())


def revocations_message(serials: frozenset[str]) -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(revocations=pb.Revocations(serials=sorted(serials)))


@dataclass(frozen=True)
class JoinTerms:
    """What `trainerctl tokens create` prints beside the token."""

    ca_pin: str
    join_address: str
    coordinators: tuple[str, ...]


class NodeDesk:
    """The coordinator's node certificates: the tokens, the revocations, the renewals, over `authority`."""

    def __init__(self, coordinator: Coordinator, authority: NodeAuthority, terms: JoinTerms | None) -> None:
        self._coordinator = coordinator
        self.authority = authority
        self._terms = terms
        self._renewing: set[str] = set()  # nodes with a renewal being signed: at most one each
        self._tasks: set[asyncio.Task] = set()
        authority.on_revoked = self._revoked_changed

    # ---------------------------------------------------------------- sessions

    def admit(self, context: grpc.aio.ServicerContext, node: str) -> KnownCertificate | None:
        """The certificate the Hello of `node` came with; Revoked when it is on the list."""
        certificate = presented_certificate(context)
        if certificate is not None and certificate.serial in self.authority.revoked:
            raise Revoked(f"the certificate of node {node} (serial {certificate.serial}) is revoked: join the host "
                          f"again with a new token")
        return certificate

    def welcomed(self, session: AgentSession, certificate: KnownCertificate | None) -> None:
        """Note the session's certificate and send its agent the list; a certificate revoked while the session
        was being opened (after `admit`, before this) closes it at once, as `_revoked_changed` would have."""
        session.certificate = certificate
        if certificate is not None and certificate.serial in self.authority.revoked:
            self._coordinator.close_session(session)
        elif self.authority.revoked:
            session.send(revocations_message(self.authority.revoked))

    def _revoked_changed(self, serials: frozenset[str]) -> None:
        """Close every session that presented a revoked certificate (its agent's next Hello is refused), and
        tell the others' agents the new list."""
        message = revocations_message(serials)
        for session in self._coordinator.open_sessions():
            if session.certificate is not None and session.certificate.serial in serials:
                log.warning("closing the session of node %s: its certificate %s is revoked", session.node,
                            session.certificate.serial)
                self._coordinator.close_session(session)
            else:
                session.send(message)

    def renew(self, session: AgentSession, csr_pem: bytes) -> None:
        """Sign a renewal in the background and send it on the session; one at a time per node."""
        if session.node in self._renewing:
            return
        self._renewing.add(session.node)
        task = asyncio.get_running_loop().create_task(self._renew(session, csr_pem))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _renew(self, session: AgentSession, csr_pem: bytes) -> None:
        try:
            if len(csr_pem) > MAX_CSR_BYTES:
                raise CertificateError(f"a certificate signing request of {len(csr_pem)} bytes")
            certificate = await self.authority.renew(session.node, csr_pem, session.certificate)
            session.send(pb.CoordinatorMessage(node_certificate=pb.NodeCertificate(
                certificate_pem=certificate.public_bytes(serialization.Encoding.PEM))))
        except Exception as exc:  # noqa: BLE001 - the agent asks again at its next check
            log.warning("the certificate of node %s was not renewed: %s", session.node, exc)
        finally:
            self._renewing.discard(session.node)

    # ---------------------------------------------------------------- operators

    async def create_token(self, request: pb.CreateTokenRequest) -> pb.CreateTokenReply:
        if self._terms is None or not self.authority.can_sign:
            raise JoinRefused("this coordinator joins no hosts: give its cluster file join (listen, ca_key_file)")
        now = self.authority.wall()
        token, record = await create_token(self.authority.store, now, request.ttl_s, request.uses or None)
        log.info("join token %s made, expiring in %.0fs, %s use(s)", token.id, request.ttl_s, request.uses or "any")
        return pb.CreateTokenReply(token=str(token), expires_at=record.expires_at, ca_pin=self._terms.ca_pin,
                                   join_address=self._terms.join_address, coordinators=self._terms.coordinators)

    async def list_tokens(self) -> pb.ListTokensReply:
        records = await list_tokens(self.authority.store, self.authority.wall())
        return pb.ListTokensReply(tokens=[
            pb.TokenInfo(id=r.id, created_at=r.created_at, expires_at=r.expires_at,
                         uses_left=-1 if r.uses_left is None else r.uses_left) for r in records])

    async def delete_token(self, token_id: str) -> str:
        await delete_token(self.authority.store, token_id)
        log.info("join token %s deleted", token_id[:20])
        return f"join token {token_id} deleted"

    async def revoke(self, node: str) -> str:
        session = self._coordinator.session_of(node)
        count = await self.authority.revoke(node, None if session is None else session.certificate)
        return (f"revoked {count} certificate(s) of node {node}: its session closes, and coordinators and agents "
                f"refuse them from now on")


class BootstrapService(pb_grpc.BootstrapServicer):
    """Served on cluster.join.listen only: anyone may ask for the CA (it is public, and the agent checks it
    against its pin); a certificate takes a token."""

    def __init__(self, authority: NodeAuthority, ca_pem: bytes) -> None:
        self._authority = authority
        self._ca_pem = ca_pem

    async def GetAuthority(self, request: pb.AuthorityRequest, context: grpc.aio.ServicerContext) -> pb.AuthorityReply:
        return pb.AuthorityReply(ca_pem=self._ca_pem)

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinReply:
        if len(request.csr_pem) > MAX_CSR_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the CSR is larger than {MAX_CSR_BYTES} bytes")
        certificate = await self._authority.join(request.token, request.node_name, request.csr_pem)
        return pb.JoinReply(certificate_pem=certificate.public_bytes(serialization.Encoding.PEM))
