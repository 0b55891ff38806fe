"""The three PEM files of a TLS party (the cluster's CA, a certificate and its key), read and checked once.

The coordinator (cluster.tls), the agent (tls in agent.yaml, or --cacert/--cert/--key) and trainerctl
(--cacert/--cert/--key or $TRAINERD_CACERT/$TRAINERD_CERT/$TRAINERD_KEY) read them here, so a missing,
unreadable or mismatched file is the same one line everywhere, before any connection is tried.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from common.config_file import ConfigError, StrictModel
from proto.launch_env import CACERT_ENV, CERT_ENV, KEY_ENV

# The command-line options of trainerctl and trainerd-agent, and the environment variables they read.
TLS_ENV = {"cacert": CACERT_ENV, "cert": CERT_ENV, "key": KEY_ENV}
TLS_OPTION_NAMES = ("--cacert", "--cert", "--key")
TLS_OPTIONS = [f"--{option} (${variable})" for option, variable in TLS_ENV.items()]
TLS_KEYS = ("ca_file", "cert_file", "key_file")


class TlsSettings(StrictModel):
    """`tls:` in the cluster and agent files: all three, or the whole key left out."""

    # The cluster's CA (`trainerd certs init` wrote it as ca.crt): the only one trusted.
    ca_file: str
    # This party's certificate, signed by that CA, and its private key.
    cert_file: str
    key_file: str


@dataclass(frozen=True)
class TlsFiles:
    """The contents of the three files: what grpc's credentials take."""

    ca: bytes
    cert: bytes
    key: bytes

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A client's: trust only the cluster's CA, present this certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def server_credentials(self) -> grpc.ServerCredentials:
        """The coordinator's: present its certificate, admit only clients with a certificate of the CA."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)


def read_tls_files(settings: TlsSettings, source: str, names: tuple[str, str, str] = TLS_KEYS) -> TlsFiles:
    """The files `settings` names, checked: the CA and the certificate parse, the key is unencrypted and
    belongs to the certificate. ConfigError otherwise, naming `source`, the file, and the key or option
    it came from (`names`: what ca_file, cert_file and key_file are called there)."""
    ca_name, cert_name, key_name = names
    ca = _read(settings.ca_file, f"{source}: {ca_name}")
    cert = _read(settings.cert_file, f"{source}: {cert_name}")
    key = _read(settings.key_file, f"{source}: {key_name}")
    try:
        authorities = x509.load_pem_x509_certificates(ca)
    except ValueError:
        raise ConfigError(f"{source}: {ca_name}: {settings.ca_file} holds no PEM certificate") from None
    try:
        leaf, *intermediates = x509.load_pem_x509_certificates(cert)
    except ValueError:
        raise ConfigError(f"{source}: {cert_name}: {settings.cert_file} holds no PEM certificate") from None
    try:
        private_key = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError):
        raise ConfigError(f"{source}: {key_name}: {settings.key_file} is not an unencrypted PEM private key") from None
    if private_key.public_key() != leaf.public_key():
        raise ConfigError(f"{source}: {key_name}: {settings.key_file} is not the key of {settings.cert_file}")
    if not _issued_by(leaf, authorities, intermediates):
        raise ConfigError(f"{source}: {cert_name}: {settings.cert_file} was not issued by the CA in "
                          f"{settings.ca_file}: a cluster's coordinator, agents and operators all use certificates "
                          f"of its one CA (`trainerd certs ... --dir` of the directory holding its ca.key)")
    return TlsFiles(ca, cert, key)


def _issued_by(leaf: x509.Certificate, authorities: list[x509.Certificate],
               intermediates: list[x509.Certificate]) -> bool:
    """Whether `leaf` was signed by one of `authorities`, directly or through the `intermediates` its file
    carries. Signatures only: a peer checks dates, names and usages when it connects."""
    current = leaf
    for _ in range(len(intermediates) + 1):
        if any(_signed(current, authority) for authority in authorities):
            return True
        issuer = next((cert for cert in intermediates if _signed(current, cert)), None)
        if issuer is None:
            return False
        current = issuer
    return False


def _signed(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def tls_settings_from_options(cacert: str | None, cert: str | None, key: str | None) -> TlsSettings | None:
    """What --cacert, --cert and --key (or their environment variables) give, None when none is given;
    ConfigError when only some are."""
    if cacert and cert and key:
        return TlsSettings(ca_file=cacert, cert_file=cert, key_file=key)
    missing = [option for option, value in zip(TLS_OPTION_NAMES, (cacert, cert, key)) if not value]
    if len(missing) == len(TLS_OPTION_NAMES):
        return None
    raise ConfigError(f"{', '.join(TLS_OPTIONS)} go together: {' and '.join(missing)} "
                      f"{'is' if len(missing) == 1 else 'are'} missing")


def unnamed_address_hint(address: str, error: str) -> str:
    """What to do when a TLS dial of the coordinator at `address` failed because its certificate does not name
    that address ("" when `error` is any other failure): the certificate is reissued, not the whole cluster's."""
    if "hostname verification check failed" not in error.lower():
        return ""
    host = address.rsplit(":", 1)[0].strip("[]")
    return (f"the coordinator's certificate does not name {host}: dial it by a name its certificate carries, or "
            f"reissue that from the cluster's CA with `trainerd certs coordinator --dir DIR --host {host}` (a --host "
            f"for every address it is dialled at; node and operator certificates stay valid)")


def _read(path: str, where: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {path}: {exc.strerror}") from exc
