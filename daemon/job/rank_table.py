"""The HCCL rank table (version 1.0) that Ascend's collective library reads from RANK_TABLE_FILE."""

from __future__ import annotations

import json

from daemon.job.placement import Placement


def build_rank_table(placement: Placement) -> dict:
    """One `server_list` entry per node in rank order; every value a string, as HCCL expects."""
    servers: dict[str, dict] = {}
    for slot in placement.ranks:
        server = servers.setdefault(slot.node, {"server_id": slot.host, "device": [], "host_nic_ip": "reserve"})
        server["device"].append(
            {"device_id": str(slot.device_id), "device_ip": slot.device_ip, "rank_id": str(slot.rank)}
        )
    return {
        "version": "1.0",
        "server_count": str(len(servers)),
        "server_list": list(servers.values()),
        "status": "completed",
    }


def rank_table_json(placement: Placement) -> str:
    return json.dumps(build_rank_table(placement), indent=2)
