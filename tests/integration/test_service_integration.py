"""What systemd and health probes see: the agent's READY/WATCHDOG notifications and gRPC health."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.harness import Processes, health, node_states
from tests.integration.cluster_files import cluster_file
from tests.ports import free_port
from tests.waiting import wait_until


def test_agent_notifies_systemd_and_serves_health(tmp_path: Path, procs: Processes) -> None:
    address = f"127.0.0.1:{free_port()}"
    notify_path = tmp_path / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify_path))
    listener.settimeout(30)
    try:
        procs.trainerd("trainerd", cluster_file(tmp_path, "c", listen=address))
        agent_dir = tmp_path / "agents" / "node-a"
        agent = procs.agent("node-a", address, env={"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "400000"})
        received: list[str] = []
        while not {"READY=1", "WATCHDOG=1"} <= set(received):
            received.extend(listener.recv(4096).decode().splitlines())
        assert received.index("READY=1") < received.index("WATCHDOG=1")
        assert any(line.startswith("STATUS=registered as node-a") for line in received)
        assert node_states(address) == {"node-a": "READY"}
        wait_until(lambda: health(f"unix:{agent_dir / 'agent.sock'}") == "SERVING", 10, "agent health SERVING")
        assert health(address) == "SERVING"
        assert health(address, "trainerd.v1.Coordinator") == "SERVING"
        assert agent.alive()
    finally:
        listener.close()
