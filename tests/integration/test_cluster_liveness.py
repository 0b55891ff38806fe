"""trainerd and agents as real processes over real gRPC and a real etcd: membership and liveness."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests.harness import Processes, health, node_states, processes_mentioning, status, trainerctl
from tests.integration.cluster_files import HEARTBEAT_TIMEOUT_S, cluster_file
from tests.ports import free_port
from tests.waiting import wait_until


def test_agents_ready_lost_and_back_under_the_same_name(tmp_path: Path, procs: Processes) -> None:
    address = f"127.0.0.1:{free_port()}"
    procs.trainerd("trainerd", cluster_file(tmp_path, "c", listen=address))
    agents = {name: procs.agent(name, address) for name in ("node-a", "node-b")}
    wait_until(lambda: node_states(address) == {"node-a": "READY", "node-b": "READY"}, 30,
               "both nodes READY", on_timeout=procs.logs)

    data = status(address)
    assert data["coordinator"]["is_leader"] is True
    assert data["coordinator"]["leader"] == address
    for node in data["nodes"]:
        assert node["devices"] == [{"device_id": 0, "device_ip": "", "kind": "cpu"}]
        assert 0 <= node["last_heartbeat_age_s"] < HEARTBEAT_TIMEOUT_S
    assert data["job"] is None

    agents["node-b"].signal(signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: node_states(address).get("node-b") == "LOST", HEARTBEAT_TIMEOUT_S + 5,
               "node-b LOST", interval=0.1, on_timeout=procs.logs)
    assert time.monotonic() - killed_at <= HEARTBEAT_TIMEOUT_S + 1.0
    assert node_states(address)["node-a"] == "READY"

    procs.agent("node-b", address)
    wait_until(lambda: node_states(address) == {"node-a": "READY", "node-b": "READY"}, 30,
               "node-b READY again", on_timeout=procs.logs)


def test_standby_takes_over_and_keeps_the_nodes(tmp_path: Path, procs: Processes, etcd_server) -> None:
    leader_address = f"127.0.0.1:{free_port()}"
    standby_address = f"127.0.0.1:{free_port()}"
    endpoints = [etcd_server.endpoint]
    leader = procs.trainerd("leader", cluster_file(tmp_path, "a", listen=leader_address, etcd_endpoints=endpoints))
    wait_until(lambda: (status(leader_address) or {}).get("coordinator", {}).get("is_leader"), 30,
               "first trainerd leads", on_timeout=procs.logs)
    procs.trainerd("standby", cluster_file(tmp_path, "b", listen=standby_address, etcd_endpoints=endpoints))
    both = f"{leader_address},{standby_address}"
    for name in ("node-a", "node-b"):
        procs.agent(name, both)
    wait_until(lambda: node_states(leader_address) == {"node-a": "READY", "node-b": "READY"}, 30,
               "both nodes READY", on_timeout=procs.logs)

    # The standby answers too, and says who leads.
    result = trainerctl("status", "-o", "json", coordinator=standby_address)
    assert result.returncode == 0, result.stderr
    wait_until(lambda: status(standby_address)["coordinator"]["leader"] == leader_address, 10,
               "standby reports the leader")

    # Health probes find the leader: only its Coordinator service is SERVING.
    assert health(leader_address, "trainerd.v1.Coordinator") == "SERVING"
    assert health(standby_address, "trainerd.v1.Coordinator") == "NOT_SERVING"
    assert health(standby_address) == "SERVING"

    leader.signal(signal.SIGKILL)
    killed_at = time.monotonic()

    def standby_leads_with_nodes() -> bool:
        data = status(standby_address)
        return bool(data and data["coordinator"]["is_leader"]
                    and {n["name"]: n["state"] for n in data["nodes"]} == {"node-a": "READY", "node-b": "READY"}
                    and all(n["last_heartbeat_age_s"] is not None for n in data["nodes"]))

    wait_until(standby_leads_with_nodes, 20, "standby leads with both nodes READY", on_timeout=procs.logs)
    takeover_s = time.monotonic() - killed_at
    assert takeover_s < 10, f"takeover took {takeover_s:.1f}s"
    assert health(standby_address, "trainerd.v1.Coordinator") == "SERVING"
    # The agents reconnected to the new leader and stay READY past a full timeout window.
    time.sleep(HEARTBEAT_TIMEOUT_S + 1)
    assert node_states(standby_address) == {"node-a": "READY", "node-b": "READY"}


def test_local_agents_and_clean_shutdown(tmp_path: Path, procs: Processes) -> None:
    address = f"127.0.0.1:{free_port()}"
    trainerd = procs.trainerd("trainerd", cluster_file(tmp_path, "c", listen=address, local_agents=2))
    wait_until(lambda: node_states(address) == {"itest-local-0": "READY", "itest-local-1": "READY"}, 40,
               "two local agents READY", on_timeout=procs.logs)
    trainerd.signal(signal.SIGTERM)
    assert trainerd.wait(timeout=30) == 0, procs.logs()
    result = trainerctl("status", coordinator=address)
    assert result.returncode == 3
    assert "cannot reach the coordinator" in result.stderr
    # trainerd took down what it started: both agents and the embedded etcd.
    wait_until(lambda: processes_mentioning(tmp_path) == [], 10, "no agent or etcd process left",
               on_timeout=lambda: "\n".join(" ".join(p.cmdline()) for p in processes_mentioning(tmp_path)))
