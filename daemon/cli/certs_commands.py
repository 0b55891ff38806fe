"""`trainerd certs ...`: make the cluster's CA and the certificates of the coordinator, nodes and operators.

Every mistake (a bad name, a missing CA, a file that already exists) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from common.cert_identity import CertificateError
from daemon.certs import (
    CA_CERT,
    CA_KEY,
    COORDINATOR_CERT,
    COORDINATOR_KEY,
    check_name,
    load_ca,
    make_ca,
    make_node_certificate,
    make_operator_certificate,
    make_server_certificate,
    refuse_existing,
    write_issued,
)


class CertsProblem(click.ClickException):
    exit_code = 2


_DIR = click.option("--dir", "directory", required=True, type=click.Path(path_type=Path, file_okay=False),
                    help="Where the CA and the certificates live.")
_FORCE = click.option("--force", is_flag=True, help="Replace files that already exist.")
_HOSTS = click.option("--host", "hosts", multiple=True, metavar="NAME_OR_IP",
                      help="A name or address agents and trainerctl reach a coordinator by (repeat; localhost and "
                           "127.0.0.1 always).")


@click.group()
def certs() -> None:
    """Make the cluster's CA and the certificates the coordinator, agents and operators present."""


@certs.command()
@_DIR
@_HOSTS
@_FORCE
def init(directory: Path, hosts: tuple[str, ...], force: bool) -> None:
    """Write a new CA (ca.crt, ca.key) and the coordinator's certificate (coordinator.crt, .key) into DIR."""
    try:
        ca = make_ca()
        server = make_server_certificate(ca, hosts)
        if not force:
            refuse_existing([directory / name for name in (CA_CERT, CA_KEY, COORDINATOR_CERT, COORDINATOR_KEY)])
        _make_dir(directory)
        written = [*write_issued(ca, directory, "ca", force), *write_issued(server, directory, "coordinator", force)]
    except CertificateError as exc:
        raise CertsProblem(str(exc)) from exc
    click.echo(f"wrote {', '.join(map(str, written))}")


@certs.command()
@_DIR
@_HOSTS
@_FORCE
def coordinator(directory: Path, hosts: tuple[str, ...], force: bool) -> None:
    """Write coordinator.crt and .key anew from DIR's CA, for every --host (the nodes' and operators' certificates
    stay valid): when agents or trainerctl dial the coordinator by an address its certificate does not name, or
    a standby coordinator joins at another."""
    try:
        written = write_issued(make_server_certificate(load_ca(directory), hosts), directory, "coordinator", force)
    except CertificateError as exc:
        raise CertsProblem(str(exc)) from exc
    click.echo(f"wrote {', '.join(map(str, written))}")


@certs.command()
@click.argument("name")
@_DIR
@_FORCE
def node(name: str, directory: Path, force: bool) -> None:
    """Write NAME.crt and NAME.key: the certificate of the node agent NAME, signed by DIR's CA."""
    try:
        check_name(name, "node")
        issued = make_node_certificate(load_ca(directory), name)
        written = write_issued(issued, directory, name, force)
    except CertificateError as exc:
        raise CertsProblem(str(exc)) from exc
    click.echo(f"wrote {', '.join(map(str, written))}")


@certs.command()
@click.argument("name")
@click.option("--read-only", is_flag=True, help="The operator may look (status, events) but change nothing.")
@_DIR
@_FORCE
def operator(name: str, read_only: bool, directory: Path, force: bool) -> None:
    """Write NAME.crt and NAME.key: the certificate of operator NAME, signed by DIR's CA."""
    try:
        check_name(name, "operator")
        issued = make_operator_certificate(load_ca(directory), name, read_only)
        written = write_issued(issued, directory, name, force)
    except CertificateError as exc:
        raise CertsProblem(str(exc)) from exc
    click.echo(f"wrote {', '.join(map(str, written))}")


def _make_dir(directory: Path) -> None:
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise CertificateError(f"{directory} cannot be created: {exc.strerror}") from exc
