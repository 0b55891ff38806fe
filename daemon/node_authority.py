"""The coordinator's side of node certificates: it signs them for agents that join with a token or renew over
their session, and refuses revoked ones (docs/security.md).

Signing needs the CA's key (cluster.join.ca_key_file); a coordinator without one joins no host and renews
nothing, but still refuses revoked certificates. What it issued is recorded per node in etcd
(`keys.node_certificates(NAME)`: serial and expiry, expired ones dropped, at most MAX_KNOWN_PER_NODE), so
that `trainerctl nodes revoke NAME` can name every certificate of the node, with the one its live session
presents (a certificate made by `trainerd certs node` is known that way). A revoked certificate is a key
`keys.revoked(SERIAL)` holding the node's name and the certificate's expiry: every coordinator watches that
prefix, refuses a Hello that presents one, closes a live session that does, and hands the list to its
agents for their SnapshotPeer. An entry goes once its certificate has expired, when no TLS handshake would
accept it anyway: the list stays as long as the certificates that are still valid.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Callable
from dataclasses import dataclass

from cryptography import x509

from common.cert_identity import CertificateError
from daemon.certs import Issued, check_name, sign_node_request
from daemon.errors import PermanentError
from daemon.join_tokens import parse_token, spend_token
from daemon.peer_auth import PermissionDenied
from daemon.store import codec, keys
from daemon.store.interface import Store, StoreError, WatchEventKind

log = logging.getLogger(__name__)

MAX_KNOWN_PER_NODE = 16
# A watch that failed is opened again after this long.
WATCH_RETRY_S = 1.0


class JoinRefused(PermanentError):
    """The coordinator cannot issue this certificate: no CA key, a bad name or request."""


class Revoked(PermissionDenied):
    """The certificate presented has been revoked (`trainerctl nodes revoke`): join the host again."""


def certificate_serial(certificate: x509.Certificate) -> str:
    """How a certificate is named in the revocation list: its serial number in lower-case hex
    (`common.cert_identity.serial_of` of its PEM)."""
    return format(certificate.serial_number, "x")


@dataclass(frozen=True)
class KnownCertificate:
    serial: str
    expires_at: float


def kept(known: list[KnownCertificate], now: float) -> list[KnownCertificate]:
    """The unexpired ones, the newest MAX_KNOWN_PER_NODE by expiry. Pure."""
    live = [entry for entry in known if entry.expires_at > now]
    return sorted(live, key=lambda entry: entry.expires_at)[-MAX_KNOWN_PER_NODE:]


class NodeAuthority:
    """Signs node certificates (with `ca`) and keeps the set of revoked serials current (`run`).

    `on_revoked(serials)` is called each time the set changes, with the whole set."""

    def __init__(self, store: Store, ca: Issued | None, validity: datetime.timedelta,
                 wall: Callable[[], float]) -> None:
        self.store = store
        self._ca = ca
        self._validity = validity
        self.wall = wall
        self.revoked: frozenset[str] = frozenset()
        self.on_revoked: Callable[[frozenset[str]], None] = lambda serials: None
        self.loaded = asyncio.Event()

    @property
    def can_sign(self) -> bool:
        return self._ca is not None

    async def join(self, token_text: str, node_name: str, request_pem: bytes) -> x509.Certificate:
        """Spend one use of the token and sign the request as node `node_name`. The request is checked before
        the token is spent, so a malformed one costs no use; TokenRefused, JoinRefused otherwise."""
        token = parse_token(token_text)
        self._check_request(node_name, request_pem)
        await spend_token(self.store, token, self.wall())
        certificate = await self._issue(node_name, request_pem)
        log.info("node %s joined with token %s: issued certificate %s", node_name, token.id,
                 certificate_serial(certificate))
        return certificate

    async def renew(self, node_name: str, request_pem: bytes, presented: KnownCertificate | None) -> x509.Certificate:
        """A new certificate for a node whose session presents `presented`. Recorded first, then withheld
        when `presented` has been revoked meanwhile: a revocation that read the node's certificates before
        this one was recorded had written its entries before this check reads them (`revoke`)."""
        self._check_request(node_name, request_pem)
        certificate = await self._issue(node_name, request_pem)
        if presented is not None and await self.store.get(keys.revoked(presented.serial)) is not None:
            raise Revoked(f"the certificate of node {node_name} was revoked while it asked for a new one")
        log.info("renewed the certificate of node %s: %s", node_name, certificate_serial(certificate))
        return certificate

    def _check_request(self, node_name: str, request_pem: bytes) -> None:
        if self._ca is None:
            raise JoinRefused("this coordinator issues no node certificates: its cluster file names no "
                              "join.ca_key_file")
        try:
            check_name(node_name, "node")
            sign_node_request(self._ca, node_name, request_pem, self._validity)  # thrown away: a check
        except CertificateError as exc:
            raise JoinRefused(str(exc)) from None

    async def _issue(self, node_name: str, request_pem: bytes) -> x509.Certificate:
        assert self._ca is not None
        certificate = sign_node_request(self._ca, node_name, request_pem, self._validity)
        await self._remember(node_name, [KnownCertificate(certificate_serial(certificate),
                                                          certificate.not_valid_after_utc.timestamp())])
        return certificate

    async def _remember(self, node_name: str, certificates: list[KnownCertificate]) -> list[KnownCertificate]:
        """Adds `certificates` to the node's record; returns what it holds now."""
        key = keys.node_certificates(node_name)
        while True:
            entry = await self.store.get(key)
            known = [] if entry is None else [KnownCertificate(str(c["serial"]), float(c["expires_at"]))
                                              for c in codec.decode(entry.value, key=key)["certificates"]]
            serials = {c.serial for c in known}
            merged = kept(known + [c for c in certificates if c.serial not in serials], self.wall())
            value = codec.encode({"certificates": [{"serial": c.serial, "expires_at": c.expires_at}
                                                   for c in merged]})
            if await self.store.compare_and_swap(key, value, 0 if entry is None else entry.mod_revision):
                return merged

    async def revoke(self, node_name: str, presented: KnownCertificate | None) -> int:
        """Revoke every certificate known of `node_name` (with `presented`, the one of its live session);
        returns how many are revoked now. JoinRefused when none is known."""
        check_name(node_name, "node")
        known = await self._remember(node_name, [presented] if presented else [])
        if not known:
            raise JoinRefused(f"no valid certificate of node {node_name} is known: it has no session and none was "
                              f"issued by joining (revoke one made by `trainerd certs` with a new CA)")
        revoked: set[str] = set()
        while new := [c for c in known if c.serial not in revoked]:  # until a renewal meanwhile is caught too
            for certificate in new:
                value = codec.encode({"node": node_name, "expires_at": certificate.expires_at})
                await self.store.compare_and_swap(keys.revoked(certificate.serial), value, 0)
                revoked.add(certificate.serial)
            known = await self._remember(node_name, [])
        await self._drop_expired(self.wall())
        log.warning("revoked the certificates of node %s: %s", node_name, ", ".join(sorted(revoked)))
        return len(revoked)

    async def _drop_expired(self, now: float) -> None:
        entries, _ = await self.store.get_prefix(keys.REVOKED)
        for entry in entries:
            if float(codec.decode(entry.value, key=entry.key)["expires_at"]) <= now:
                await self.store.delete(entry.key, entry.mod_revision)

    async def run(self) -> None:
        """Keep `revoked` current: read the list, then watch it, until cancelled."""
        while True:
            try:
                entries, revision = await self.store.get_prefix(keys.REVOKED)
                self._set({entry.key.removeprefix(keys.REVOKED) for entry in entries})
                self.loaded.set()
                serials = set(self.revoked)
                async for event in self.store.watch_prefix(keys.REVOKED, revision + 1):
                    serial = event.key.removeprefix(keys.REVOKED)
                    if event.kind is WatchEventKind.PUT:
                        serials.add(serial)
                    else:
                        serials.discard(serial)
                    self._set(serials)
            except StoreError as exc:
                log.warning("the revoked certificates cannot be read (%s); trying again", exc)
            await asyncio.sleep(WATCH_RETRY_S)

    def _set(self, serials: set[str]) -> None:
        new = frozenset(serials)
        if new != self.revoked:
            self.revoked = new
            self.on_revoked(new)
