"""The coordinator's node certificates on the in-memory store: what is signed and recorded, what a revocation
covers (and that it is not stopped by an unknown node), that a renewal for a revoked certificate is withheld, that
the watched list follows etcd's, and that the record of a node stays bounded."""

from __future__ import annotations

import asyncio
import datetime
import time

import pytest
from cryptography.hazmat.primitives import serialization

from agent.join import new_key, signing_request
from common.cert_identity import PeerKind, peer_identity
from common.clock import FakeClock
from daemon.certs import make_ca
from daemon.join_tokens import TokenRefused, create_token, spend_token
from daemon.node_authority import (
    MAX_KNOWN_PER_NODE,
    JoinRefused,
    KnownCertificate,
    NodeAuthority,
    Revoked,
    certificate_serial,
    kept,
)
from daemon.store.memory import InMemoryStore

NOW = time.time()  # the certificates are made from the real clock


def authority(store: InMemoryStore, can_sign: bool = True) -> NodeAuthority:
    return NodeAuthority(store, make_ca() if can_sign else None, datetime.timedelta(days=30), lambda: NOW)


def test_the_record_of_a_node_keeps_the_newest_unexpired() -> None:
    known = [KnownCertificate(str(i), NOW + i) for i in range(-3, 2 * MAX_KNOWN_PER_NODE)]
    assert [c.serial for c in kept(known, NOW)] == [str(i) for i in range(MAX_KNOWN_PER_NODE, 2 * MAX_KNOWN_PER_NODE)]


def test_join_revoke_and_a_renewal_withheld() -> None:
    async def scenario() -> None:
        store = InMemoryStore(FakeClock())
        nodes = authority(store)
        watching = asyncio.create_task(nodes.run())
        await nodes.loaded.wait()
        token, _ = await create_token(store, NOW, 60, 1)
        with pytest.raises(JoinRefused, match="not valid"):
            await nodes.join(str(token), "../x", signing_request(new_key(), "x"))
        joined = await nodes.join(str(token), "n1", signing_request(new_key(), "anything"))  # the name is ours
        pem = joined.public_bytes(serialization.Encoding.PEM)
        assert (peer_identity(pem).kind, peer_identity(pem).name) == (PeerKind.NODE, "n1")
        with pytest.raises(TokenRefused, match="is spent"):
            await nodes.join(str(token), "n2", signing_request(new_key(), "n2"))

        first = KnownCertificate(certificate_serial(joined), joined.not_valid_after_utc.timestamp())
        renewed = await nodes.renew("n1", signing_request(new_key(), "n1"), first)
        with pytest.raises(JoinRefused, match="no valid certificate of node n9"):
            await nodes.revoke("n9", None)
        assert await nodes.revoke("n1", first) == 2
        for _ in range(100):
            if nodes.revoked == {first.serial, certificate_serial(renewed)}:
                break
            await asyncio.sleep(0.01)
        assert nodes.revoked == {first.serial, certificate_serial(renewed)}
        with pytest.raises(Revoked, match="revoked while it asked"):
            await nodes.renew("n1", signing_request(new_key(), "n1"), first)
        watching.cancel()

    asyncio.run(scenario())


def test_a_coordinator_without_the_ca_key_signs_nothing() -> None:
    async def scenario() -> None:
        store = InMemoryStore(FakeClock())
        token, _ = await create_token(store, NOW, 60, 1)
        with pytest.raises(JoinRefused, match="no join.ca_key_file"):
            await authority(store, can_sign=False).join(str(token), "n1", signing_request(new_key(), "n1"))
        await spend_token(store, token, NOW)  # the refusal spent no use

    asyncio.run(scenario())
