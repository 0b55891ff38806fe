"""The pin a joining agent trusts the cluster by: `sha256:HEX`, the SHA-256 of the CA certificate's DER (as
kubeadm's `--discovery-token-ca-cert-hash`). The agent has no CA file yet when it joins; it accepts the
coordinator it dials only once the CA that coordinator hands it hashes to the pin it was given.
"""

from __future__ import annotations

import hashlib
import re

from cryptography import x509
from cryptography.hazmat.primitives import serialization

PIN_PREFIX = "sha256:"
_PIN = re.compile(r"sha256:[0-9a-f]{64}")


def ca_pin(ca_pem: bytes) -> str:
    """The pin of the first certificate in `ca_pem`; ValueError when it holds none."""
    certificate = x509.load_pem_x509_certificates(ca_pem)[0]
    return PIN_PREFIX + hashlib.sha256(certificate.public_bytes(serialization.Encoding.DER)).hexdigest()


def check_pin(pin: str) -> str:
    """`pin` in its one form (lower case); ValueError, one line, when it is not `sha256:` and 64 hex digits."""
    normal = pin.strip().lower()
    if not _PIN.fullmatch(normal):
        raise ValueError(f"{pin[:80]!r} is not a CA pin: sha256: and 64 hex digits (trainerctl tokens create "
                         f"prints it)")
    return normal
