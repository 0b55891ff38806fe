"""The coordinator's `/metrics` listener: Prometheus' text served by a thread per connection, over HTTPS with
client certificates when the cluster has TLS.

prometheus_client's own server wraps its listening socket in TLS, so each connection's handshake runs inside
`accept()`, on the one thread that accepts them all, with no timeout: one idle TCP connection (a port scan, a
half-open link) stalled every scrape behind it for as long as it stayed open. Here the listening socket stays
plain; each accepted connection gets a thread of its own, which does the handshake there, and every read,
the handshake's included, gives up after `timeout_s`. At most `max_connections` are served at once; one more
is closed at once, so idle connections cannot pile up threads either.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import prometheus_client

from common.config_file import parse_host_port
from common.tls_files import TlsSettings

log = logging.getLogger(__name__)

# A scrape sends its request at once, and a slow scraper is still read within this.
CONNECTION_TIMEOUT_S = 10.0
# Prometheus scrapes with one connection per target; more is room for people and a second scraper.
MAX_CONNECTIONS = 32


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class names it so
        """A scrape every few seconds is not news."""


class MetricsServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, which completes the TLS handshake (with `tls_context`) before the request."""

    daemon_threads = True  # ThreadingMixIn then keeps no list of them

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily, tls_context: ssl.SSLContext | None,
                 timeout_s: float = CONNECTION_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS) -> None:
        self.address_family = family
        self._tls_context = tls_context
        self._timeout_s = timeout_s
        self._connections = threading.BoundedSemaphore(max_connections)
        super().__init__(address, _QuietHandler)
        self.set_app(prometheus_client.make_wsgi_app())

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._connections.acquire(blocking=False):
            log.debug("closed a /metrics connection from %s: as many as allowed are open", client_address)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts process_request_thread
        except BaseException:
            self._connections.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """The connection's own thread: the handshake, then the request, each read within `timeout_s`."""
        try:
            request.settimeout(self._timeout_s)
            if self._tls_context is not None:
                request = self._tls_context.wrap_socket(request, server_side=True)
            self.finish_request(request, client_address)
        except OSError as exc:  # the handshake refused or timed out, the client left or stalled
            log.debug("a /metrics connection from %s ended: %s", client_address, exc)
        finally:
            self.shutdown_request(request)
            self._connections.release()


def tls_context(tls: TlsSettings) -> ssl.SSLContext:
    """The coordinator's certificate, for clients with a certificate of the cluster's CA only."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert_file, tls.key_file)
    context.load_verify_locations(tls.ca_file)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def start_metrics_server(address: str, tls: TlsSettings | None,
                         timeout_s: float = CONNECTION_TIMEOUT_S) -> MetricsServer:
    """Prometheus `/metrics` on `address`, served by threads; with TLS over HTTPS with the coordinator's
    certificate, for scrapers with a client certificate of the CA (an operator's, a read-only one will do).
    OSError when it cannot listen."""
    host, port = parse_host_port(address)
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server = MetricsServer((host, port), family, None if tls is None else tls_context(tls), timeout_s)
    threading.Thread(target=server.serve_forever, name="metrics listener", daemon=True).start()
    return server
