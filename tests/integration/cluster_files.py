"""Cluster files for the integration tests, on distinct ports, and a look for leftover processes."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.ports import free_port

HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 2.0


def cluster_file(tmp_path: Path, name: str, *, listen: str, etcd_endpoints: list[str] | None = None,
                 local_agents: int = 0, job: dict | None = None, security: dict | None = None,
                 metrics_listen: str | None = None, warm_workers: bool = True) -> Path:
    """`security`: cluster.tls and cluster.insecure, e.g. {"tls": {"ca_file": ..., ...}}; `metrics_listen`:
    where the coordinator serves Prometheus metrics; `warm_workers`: the local agents' (on, as in the product:
    see tests/harness.py `Processes.agent`)."""
    etcd: dict = {"endpoints": etcd_endpoints or [], "data_dir": str(tmp_path / f"{name}-etcd")}
    if not etcd_endpoints:
        etcd["client_listen"] = f"127.0.0.1:{free_port()}"
        etcd["peer_listen"] = f"127.0.0.1:{free_port()}"
    data = {
        "cluster": {
            "name": "itest",
            "coordinator": {"listen": listen, "leader_lease_s": 2,
                            **({"metrics_listen": metrics_listen} if metrics_listen else {})},
            "etcd": etcd,
            "heartbeat": {"interval_s": HEARTBEAT_INTERVAL_S, "timeout_s": HEARTBEAT_TIMEOUT_S},
            "local_agents": local_agents,
            "local_agent": {"work_dir": str(tmp_path / f"{name}-agents"), "warm_workers": warm_workers},
            **(security or {}),
        }
    }
    if job is not None:
        data["job"] = job
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


