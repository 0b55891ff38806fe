"""A trainerd killed by SIGKILL runs no clean-up: what it started must end by itself, not live on beside the
next trainerd (its etcd holding the ports and answering for the next one's, its local agents under the node
names the next one's use), and trainerd started again must lead as before. Real trainerd, etcd and agents."""

from __future__ import annotations

import signal
from pathlib import Path

import psutil

from tests.harness import Processes
from tests.integration.cluster_files import cluster_file
from tests.integration.test_embedded_etcd import leads_with
from tests.ports import free_port
from tests.waiting import wait_until


def test_a_trainerd_killed_by_sigkill_takes_its_etcd_and_local_agents_with_it_and_starts_again(
        tmp_path: Path, procs: Processes) -> None:
    address = f"127.0.0.1:{free_port()}"
    path = cluster_file(tmp_path, "c", listen=address, local_agents=2)
    ready = {"itest-local-0": "READY", "itest-local-1": "READY"}
    trainerd = procs.trainerd("trainerd", path)
    wait_until(lambda: leads_with(address, ready), 60, "trainerd leads with its two local agents READY",
               on_timeout=procs.logs)
    children = psutil.Process(trainerd.pid).children()
    assert sorted(_kind(child) for child in children) == ["agent", "agent", "etcd"], children

    trainerd.signal(signal.SIGKILL)
    trainerd.wait(timeout=10)
    wait_until(lambda: not any(_running(child) for child in children), 30,
               f"etcd and the local agents ({[c.pid for c in children]}) to end with trainerd", on_timeout=procs.logs)
    assert "stopping" in (tmp_path / "c-agents" / "itest-local-0" / "agent.log").read_text()  # SIGTERM, not a kill

    procs.trainerd("trainerd-again", path)
    wait_until(lambda: leads_with(address, ready), 60, "trainerd started again leads with its local agents READY",
               on_timeout=procs.logs)


def _kind(process: psutil.Process) -> str:
    cmdline = process.cmdline()
    return "agent" if "agent.main" in cmdline else process.name()


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
