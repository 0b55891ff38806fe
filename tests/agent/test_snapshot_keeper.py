"""The supervisor's in-memory snapshots across hosts (agent/snapshots/snapshot_keeper.py), with the fake launcher and a
real SnapshotPeer server on loopback for the other host: a relaunch assembles the snapshot it resumes from out
of its own files and a peer's, a snapshot that cannot be had starts no worker (each is reported exited 65 and
the coordinator falls back to the next newest source), and a generation spanning hosts reports what it holds and copies its
ring predecessor's snapshots."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from agent.commands import Launch, PeerAgent, SnapshotSource, Stop
from agent.snapshots.memory_snapshots import HostScope, MemorySnapshotDir, Snapshot, step_dir_name
from agent.snapshots.peer_client import PeerClient
from agent.snapshots.peer_copier import POLL_INTERVAL_S
from agent.snapshots.peer_service import PeerServer
from common.tls_files import TlsFiles
from daemon.certs import make_ca, make_node_certificate
from tests.agent.snapshot_files import TENSORS, host_snapshot
from tests.agent.supervisor_fakes import Host, launch, run
from tests.ports import free_port
from tests.waiting import wait_until
from trainer.checkpoint import load_checkpoint

JOB = "job"


def host_memory(tmp_path: Path, name: str, rank: int, steps: tuple[int, ...], generation: int = 3) -> MemorySnapshotDir:
    """A host that ran `rank` of 2 in `generation`, its snapshots of `steps` pinned."""
    memory = MemorySnapshotDir(tmp_path / name)
    job_dir = memory.prepare(JOB, None, HostScope((rank,), 2, generation))
    for step in steps:
        host_snapshot(job_dir, step, (rank,), world_size=2, generation=generation)
        assert memory.newest(JOB) == Snapshot(step, 8 * step)
    return memory


@pytest.fixture
def peer_host(tmp_path: Path) -> Iterator[tuple[MemorySnapshotDir, PeerAgent]]:
    """Host "h1", which ran rank 1 of generation 3 and holds its snapshot of step 50, serving it."""
    memory = host_memory(tmp_path, "h1", 1, (50,))
    server = PeerServer(memory, "127.0.0.1", None)
    port = server.start()
    yield memory, PeerAgent(node="h1", address=f"127.0.0.1:{port}")
    server.stop()


@pytest.fixture
def peers() -> Iterator[PeerClient]:
    client = PeerClient(None)
    yield client
    client.close()


def relaunch(generation: int, sources: list[SnapshotSource], **env: str) -> Launch:
    """A one-rank generation resuming from the in-memory snapshot of step 50 of a world of 2."""
    return launch(generation, workers=1, snapshot_sources=tuple(sources),
                  env={"TRAINERD_MEMORY_EVERY": "5", "TRAINERD_RESUME_STEP": "50", "TRAINERD_RESUME_MEMORY_STEP": "50",
                       "TRAINERD_RESUME_FROM": "", "RANK_SIZE": "1", **env})


def test_a_relaunch_assembles_its_snapshot_from_its_own_files_and_a_peers(tmp_path: Path, peer_host,
                                                                          peers: PeerClient) -> None:
    async def scenario() -> None:
        _, h1 = peer_host
        memory = host_memory(tmp_path, "h0", 0, (50,))
        host = Host(tmp_path / "work", memory=memory, peers=peers)
        (tmp_path / "work").mkdir()
        h0 = PeerAgent(node="h0", address="127.0.0.1:1")  # never dialled: its rank is here
        await host.supervisor.launch(relaunch(4, [SnapshotSource(rank=0, holder=h0),
                                                  SnapshotSource(rank=1, holder=h1)]))
        resume_from = Path(host.launcher.started["rank0"].env["TRAINERD_RESUME_FROM"])
        assert resume_from == memory.job_dir(JOB) / ".resume" / step_dir_name(50)
        for rank, world in ((0, 1), (0, 2), (1, 2)):  # resharded to 1 rank, and as it was
            tensors, manifest = load_checkpoint(resume_from, rank, world)
            assert manifest.step == 50 and manifest.world_size == 2
            assert all(np.array_equal(tensors[name], value) for name, value in TENSORS.items())

    run(scenario())


class LaunchArrives(logging.Handler):
    """Names generation 4's nodes to `server` once it refused a peer: that Launch reached it late."""

    def __init__(self, server: PeerServer) -> None:
        super().__init__()
        self.server = server
        self.refusals: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("refused a snapshot peer call of node"):
            self.refusals.append(record.getMessage())
            self.server.serve_generation(4, ("h0", "h1"))


def test_a_relaunch_fetches_from_a_holder_whose_launch_came_after_its_own(tmp_path: Path) -> None:
    """Each holder serves the nodes its newest Launch names; the fetching node's Launch may come first, and the
    holder's refusal then (NotServedYet) is asked again rather than giving the snapshot up."""
    ca = make_ca()

    def tls(node: str) -> TlsFiles:
        leaf = make_node_certificate(ca, node)
        return TlsFiles(ca.certificate_pem(), leaf.certificate_pem(), leaf.key_pem())

    server = PeerServer(host_memory(tmp_path, "h1", 1, (50,)), "127.0.0.1", tls("h1"))
    server.serve_generation(3, ("h1", "h2"))  # h0 is new to the job
    h1 = PeerAgent(node="h1", address=f"127.0.0.1:{server.start()}")
    peers = PeerClient(tls("h0"))
    arrives = LaunchArrives(server)
    logging.getLogger("agent.snapshots.peer_service").addHandler(arrives)

    async def scenario() -> Host:
        host = Host(tmp_path / "work", memory=host_memory(tmp_path, "h0", 0, (50,)), peers=peers)
        (tmp_path / "work").mkdir()
        h0 = PeerAgent(node="h0", address="127.0.0.1:1")  # never dialled: its rank is here
        await host.supervisor.launch(relaunch(4, [SnapshotSource(rank=0, holder=h0),
                                                  SnapshotSource(rank=1, holder=h1)]))
        return host

    try:
        host = run(scenario())
    finally:
        logging.getLogger("agent.snapshots.peer_service").removeHandler(arrives)
        peers.close()
        server.stop()
    assert arrives.refusals == ["refused a snapshot peer call of node h0: not of generation 3"]
    assert "rank0" in host.launcher.started and not host.sent("process_exited")


def test_a_snapshot_that_cannot_be_fetched_starts_no_worker_and_is_reported_unloadable(
        tmp_path: Path, peers: PeerClient, caplog) -> None:
    """Issue 47: when assembly failed the workers were started anyway, without a snapshot, at the step the Launch
    named (2**62 once). Now none starts: each is reported exited 65 with why, and the coordinator marks the step
    bad and relaunches from the next newest source."""
    async def scenario() -> None:
        memory = host_memory(tmp_path, "h0", 0, (50,))
        host = Host(tmp_path / "work", memory=memory, peers=peers)
        (tmp_path / "work").mkdir()
        gone = PeerAgent(node="h1", address=f"127.0.0.1:{free_port()}")  # its host died since
        with caplog.at_level(logging.ERROR, "agent.snapshots.snapshot_keeper"):
            await host.supervisor.launch(relaunch(4, [SnapshotSource(rank=0, holder=gone),
                                                      SnapshotSource(rank=1, holder=gone)]))
        assert "rank0" not in host.launcher.started
        [exited] = host.sent("process_exited")
        assert (exited.rank, exited.exit_code) == (0, 65)
        assert exited.cause.message.startswith("cannot resume from the in-memory snapshot of step 50: ")
        [error] = [r.message for r in caplog.records if r.name == "agent.snapshots.snapshot_keeper"]
        assert "cannot resume from the in-memory snapshot of step 50" in error and "rank 1" in error, error
        assert not (memory.job_dir(JOB) / ".resume" / step_dir_name(50)).exists()

    run(scenario())


def test_a_generation_across_hosts_reports_what_it_holds_and_copies_its_predecessor(tmp_path: Path, peers,
                                                                                    memory_fs: Path) -> None:
    async def scenario() -> None:
        predecessor = host_memory(tmp_path, "h1", 1, (), generation=5)
        server = PeerServer(predecessor, "127.0.0.1", None)
        h1 = PeerAgent(node="h1", address=f"127.0.0.1:{server.start()}")
        try:
            memory = MemorySnapshotDir(memory_fs / "h0")
            host = Host(tmp_path / "work", memory=memory, peers=peers)
            (tmp_path / "work").mkdir()
            message = launch(5, workers=1, copy_from=h1, env={"TRAINERD_MEMORY_EVERY": "5", "TRAINERD_RESUME_STEP": "",
                                                              "TRAINERD_MEMORY_SCOPE": "host", "RANK_SIZE": "2"})
            await host.supervisor.launch(message)
            job_dir = memory.job_dir(JOB)
            assert host.launcher.started["rank0"].env["TRAINERD_MEMORY_DIR"] == str(job_dir)
            host_snapshot(job_dir, 20, (0,), world_size=2, generation=5)
            heartbeat = host.supervisor.heartbeat()
            assert not heartbeat.HasField("memory_snapshot")  # no rank commits in scope host
            assert [(s.step, list(s.ranks)) for s in heartbeat.held_snapshots] == [(20, [0])]

            host_snapshot(predecessor.job_dir(JOB), 20, (1,), world_size=2, generation=5)
            wait_until(lambda: [(s.step, list(s.ranks)) for s in host.supervisor.heartbeat().held_snapshots]
                       == [(20, [0, 1])], 15, "rank 1's files copied from h1")
            await host.supervisor.stop(Stop(generation=5, grace_s=1.0))
            [stopped] = host.sent("stopped")
            assert [(s.step, list(s.ranks), s.world_size, s.generation) for s in stopped.held_snapshots] == [
                (20, [0, 1], 2, 5)]
            host_snapshot(predecessor.job_dir(JOB), 30, (1,), world_size=2, generation=5)
            predecessor.newest(JOB)
            await asyncio.sleep(5 * POLL_INTERVAL_S)  # the copier stopped with the generation: nothing more comes
            assert sorted(p.name for p in (memory.copies_root(JOB) / "h1").iterdir()) == [step_dir_name(20)]
        finally:
            server.stop()

    run(scenario())
