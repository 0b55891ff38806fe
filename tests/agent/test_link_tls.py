"""The agent's CoordinatorLink over real mutual TLS (certificates from `trainerd certs`): it reaches a
coordinator of its CA with its node certificate, never one with another CA's certificate, and over TLS it
follows a leader hint only to a coordinator it was configured with."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner

from agent.session import CoordinatorLink, IdentityFile
from common.clock import SystemClock
from common.tls_files import TlsFiles, TlsSettings, read_tls_files
from daemon.cli.trainerd_main import cli as trainerd_cli
from proto import trainerd_pb2 as pb
from proto import trainerd_pb2_grpc as pb_grpc
from tests.agent.test_coordinator_link import LeaderCoordinator, RecordingHandler, StandbyCoordinator, running

WAIT_S = 5.0
# Long enough for several reconnect attempts (the backoff starts at 0.1-0.2 s).
SEVERAL_ATTEMPTS_S = 1.5


def tls_files(directory: Path, stem: str) -> TlsFiles:
    return read_tls_files(TlsSettings(ca_file=str(directory / "ca.crt"), cert_file=str(directory / f"{stem}.crt"),
                                      key_file=str(directory / f"{stem}.key")), "test")


def make_pki(directory: Path) -> Path:
    for argv in (["init"], ["node", "n1"]):
        result = CliRunner().invoke(trainerd_cli, ["certs", *argv, "--dir", str(directory)])
        assert result.exit_code == 0, result.output
    return directory


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("other-pki"))


@asynccontextmanager
async def serving_tls(servicer: pb_grpc.CoordinatorServicer, pki: Path) -> AsyncIterator[str]:
    server = grpc.aio.server()
    pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", tls_files(pki, "coordinator").server_credentials())
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def tls_link(addresses: list[str], work_dir: Path, pki: Path) -> CoordinatorLink:
    hello = pb.Hello(node_name="n1", host="10.0.0.1", agent_version="test",
                     devices=[pb.Device(device_id=0, kind="cpu")])
    return CoordinatorLink(addresses=addresses, hello=hello, identity=IdentityFile(work_dir / "identity.json"),
                           clock=SystemClock(), credentials=tls_files(pki, "n1").channel_credentials())


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_the_link_registers_over_tls_with_a_coordinator_of_its_ca(tmp_path: Path, pki: Path) -> None:
    leader = LeaderCoordinator("c1")

    async def scenario() -> None:
        async with serving_tls(leader, pki) as address:
            link = tls_link([address], tmp_path, pki)
            async with running(link, RecordingHandler()):
                await asyncio.wait_for(link.connected.wait(), WAIT_S)
                assert (await leader.next_received("heartbeat")).heartbeat.sequence == 1

    run(scenario())


def test_the_link_never_talks_to_a_coordinator_of_another_ca(tmp_path: Path, pki: Path, other_pki: Path) -> None:
    impostor = LeaderCoordinator("impostor")

    async def scenario() -> None:
        async with serving_tls(impostor, other_pki) as address:
            link = tls_link([address], tmp_path, pki)
            async with running(link, RecordingHandler()):
                await asyncio.sleep(SEVERAL_ATTEMPTS_S)
                assert not link.connected.is_set()
        assert impostor.hellos.empty()  # not even the Hello left the agent

    run(scenario())


def test_over_tls_a_hint_to_an_unconfigured_address_is_logged_and_ignored(
    tmp_path: Path, pki: Path, caplog: pytest.LogCaptureFixture
) -> None:
    elsewhere = LeaderCoordinator("elsewhere")

    async def scenario() -> int:
        async with serving_tls(elsewhere, pki) as elsewhere_address:
            standby = StandbyCoordinator(elsewhere_address)
            async with serving_tls(standby, pki) as standby_address:
                link = tls_link([standby_address], tmp_path, pki)
                with caplog.at_level(logging.WARNING, logger="agent.session"):
                    async with running(link, RecordingHandler()):
                        await asyncio.sleep(SEVERAL_ATTEMPTS_S)
                assert elsewhere.hellos.empty()
                return standby.refused

    refused = run(scenario())
    assert refused >= 2  # it kept to the configured coordinator
    ignored = [r.getMessage() for r in caplog.records if "ignoring the hint" in r.getMessage()]
    assert ignored and all("names the leader at 127.0.0.1:" in m and "which is not among the configured "
                           "coordinators" in m for m in ignored), ignored


def test_over_tls_a_hint_to_a_configured_coordinator_is_followed(tmp_path: Path, pki: Path) -> None:
    leader = LeaderCoordinator("c2")

    async def scenario() -> None:
        async with serving_tls(leader, pki) as leader_address:
            standby, other = StandbyCoordinator(leader_address), StandbyCoordinator(leader_address)
            async with serving_tls(standby, pki) as standby_address, serving_tls(other, pki) as other_address:
                # Without the hint the second attempt would go to `other`.
                link = tls_link([standby_address, other_address, leader_address], tmp_path, pki)
                async with running(link, RecordingHandler()):
                    await asyncio.wait_for(link.connected.wait(), WAIT_S)
                    assert (standby.refused, other.refused) == (1, 0)

    run(scenario())
