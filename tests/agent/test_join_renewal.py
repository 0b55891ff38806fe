"""When a node certificate is renewed (pure), and the agent's side of a renewal: a new key per request, the answer
checked against it and kept, one not asked for or for another key ignored."""

from __future__ import annotations

import datetime
import stat
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from agent.join import Renewal, new_key, renewal_due, signing_request, stored_tls
from common.cert_identity import serial_of
from common.tls_files import TlsFiles
from daemon.certs import make_ca, make_node_certificate, sign_node_request, write_issued
from proto import trainerd_pb2 as pb

DAY = datetime.timedelta(days=1)


def test_a_certificate_is_due_once_less_than_a_third_of_it_is_left() -> None:
    ca = make_ca()
    start = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    pem = sign_node_request(ca, "n1", _request(), 30 * DAY, now=start + datetime.timedelta(hours=1)).public_bytes(
        serialization.Encoding.PEM)
    assert not renewal_due(pem, start + 19 * DAY)
    assert renewal_due(pem, start + 21 * DAY)


def test_the_agent_keeps_what_it_asked_for_and_nothing_else(tmp_path: Path) -> None:
    ca = make_ca()
    settings = stored_tls(tmp_path)
    Path(settings.ca_file).parent.mkdir()
    write_issued(ca, tmp_path / "tls", "ca", force=False)
    issued = make_node_certificate(ca, "n1")
    Path(settings.cert_file).write_bytes(issued.certificate_pem())
    Path(settings.key_file).write_bytes(issued.key_pem())
    sent: list[pb.AgentMessage] = []
    renewed: list[TlsFiles] = []
    renewal = Renewal(settings, "n1", sent.append, renewed.append)

    renewal.check(datetime.datetime.now(datetime.timezone.utc))
    assert sent == []  # 825 days left
    expires = issued.certificate.not_valid_after_utc
    renewal.check(expires - DAY)
    renewal.check(expires - DAY)
    assert len(sent) == 1  # one request at a time
    request = sent[0].renew_certificate.csr_pem
    assert x509.load_pem_x509_csr(request).subject.rfc4514_string() == "CN=n1"

    other = sign_node_request(ca, "n1", _request(), 30 * DAY).public_bytes(serialization.Encoding.PEM)
    renewal.received(other)  # signed for a key it never made
    assert renewed == [] and Path(settings.cert_file).read_bytes() == issued.certificate_pem()

    renewal.check(expires - DAY)
    answer = sign_node_request(ca, "n1", sent[-1].renew_certificate.csr_pem, 30 * DAY)
    renewal.received(answer.public_bytes(serialization.Encoding.PEM))
    assert serial_of(Path(settings.cert_file).read_bytes()) == format(answer.serial_number, "x")
    assert stat.S_IMODE(Path(settings.key_file).stat().st_mode) == 0o600
    key = serialization.load_pem_private_key(Path(settings.key_file).read_bytes(), password=None)
    assert key.public_key() == answer.public_key()
    assert len(renewed) == 1 and renewed[0].cert == Path(settings.cert_file).read_bytes()
    renewal.received(answer.public_bytes(serialization.Encoding.PEM))  # not asked for again: ignored
    assert len(renewed) == 1


def _request() -> bytes:
    return signing_request(new_key(), "n1")
