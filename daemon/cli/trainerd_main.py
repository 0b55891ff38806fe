"""`trainerd start --cluster cluster.yaml`: run the coordinator; `trainerd certs ...`: make its certificates."""

from __future__ import annotations

from common import grpc_core_settings

grpc_core_settings.apply()  # before anything imports grpc: its core reads these settings then

import asyncio
import logging
import sys

import click

from common.cert_identity import CertificateError
from common.config_file import ConfigError
from common.start_refused import StartRefused
from common.tls_files import read_tls_files
from daemon.app import ListenError, TrainerdApp, install_stop_signals, load_join_ca
from daemon.cli.certs_commands import certs
from daemon.cli.command_groups import PointingGroup
from daemon.config import load_cluster_config
from daemon.etcd_process import EtcdNotFound, EtcdStartError, check_serving_certificate
from daemon.store.interface import StoreError


@click.group(cls=PointingGroup)
def cli() -> None:
    """trainerd: the coordinator of fault-tolerant elastic MindSpore training."""


@cli.command()
@click.option("--cluster", "cluster_file", required=True, type=click.Path(dir_okay=False),
              help="Cluster file (YAML), see configs/cluster.example.yaml.")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def start(cluster_file: str, log_level: str) -> None:
    """Run the coordinator (and an embedded etcd when the file names no endpoints)."""
    try:
        config = load_cluster_config(cluster_file)
        tls_settings = config.cluster.tls
        tls = None if tls_settings is None else read_tls_files(
            tls_settings, cluster_file, ("cluster.tls.ca_file", "cluster.tls.cert_file", "cluster.tls.key_file"))
        if tls is not None and tls_settings is not None and not config.cluster.etcd.endpoints:
            check_serving_certificate(tls, tls_settings, config.cluster.etcd.client_listen, cluster_file)
        join_ca = load_join_ca(config)
    except (ConfigError, CertificateError) as exc:
        raise StartRefused(str(exc)) from exc
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s trainerd %(name)s: %(message)s")
    for noisy in ("grpc", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    async def serve() -> None:
        stop = asyncio.Event()
        install_stop_signals(stop)
        await TrainerdApp(config, tls, join_ca).run(stop)

    try:
        asyncio.run(serve())
    except (EtcdNotFound, EtcdStartError, ListenError, StoreError, OSError) as exc:
        click.echo(f"trainerd: {exc}", err=True)
        sys.exit(1)


cli.add_command(certs)


def main() -> None:
    cli(prog_name="trainerd")


if __name__ == "__main__":
    main()
