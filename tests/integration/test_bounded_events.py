"""A real trainerd on a real etcd that holds more events than one 4 MiB read could return: it takes
leadership and keeps it, `status` and `events` answer, and the leader compacts the events to
cluster.events.keep. No MindSpore."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from daemon.store import codec, keys
from daemon.store.etcd import EtcdStore
from tests.harness import Processes, status, trainerctl
from tests.integration.cluster_files import cluster_file
from tests.ports import free_port
from tests.waiting import wait_until

EVENTS = 20_000
KEEP = 10_000  # cluster.events.keep's default
GRPC_MESSAGE_LIMIT = 4 * 1024 * 1024


async def write_events(endpoint: str, job: str, count: int) -> int:
    """`count` events of a few hundred bytes, written concurrently; returns their total size."""
    store = await EtcdStore.connect([endpoint])
    total = 0
    try:
        for first in range(1, count + 1, 500):
            values = {seq: codec.encode({"seq": seq, "at": time.time(), "kind": "filler", "fields": {"n": seq},
                                         "message": f"filler event {seq} " + "x" * 300})
                      for seq in range(first, min(first + 500, count + 1))}
            written = await asyncio.gather(*(store.compare_and_swap(keys.event(job, seq), value, 0)
                                             for seq, value in values.items()))
            assert all(written)
            total += sum(len(keys.event(job, seq)) + len(value) for seq, value in values.items())
    finally:
        await store.close()
    return total


def test_a_coordinator_leads_and_answers_with_more_events_than_one_read_can_hold(
        tmp_path: Path, procs: Processes, etcd_server) -> None:
    size = asyncio.run(write_events(etcd_server.endpoint, "itest", EVENTS))
    assert size > GRPC_MESSAGE_LIMIT * 1.3, size  # the old whole-prefix read failed here

    address = f"127.0.0.1:{free_port()}"
    trainerd = procs.trainerd("trainerd", cluster_file(tmp_path, "c", listen=address,
                                                       etcd_endpoints=[etcd_server.endpoint]))
    procs.agent("node-a", address)

    def leads_with_node_a() -> bool:
        data = status(address)
        return bool(data and data["coordinator"]["is_leader"]
                    and [(n["name"], n["state"]) for n in data["nodes"]] == [("node-a", "READY")])

    wait_until(leads_with_node_a, 30, "trainerd leads with node-a READY", on_timeout=procs.logs)

    def listed() -> list[dict]:
        result = trainerctl("events", "-o", "json", coordinator=address, timeout=60)
        assert result.returncode == 0, result.stderr
        return [json.loads(line) for line in result.stdout.splitlines()]

    def compacted() -> list[dict] | None:
        events = listed()
        # One pass deletes at most 10,000 (EVENTS - KEEP): this coordinator's own two (coordinator_leads and
        # node-a's node_joined) stay over until the next pass, a minute later.
        return events if len(events) <= KEEP + 2 else None

    events = wait_until(compacted, 30, f"the events compacted to {KEEP}", interval=1.0, on_timeout=procs.logs)
    seqs = [e["seq"] for e in events]
    assert seqs == list(range(seqs[0], seqs[-1] + 1)) and seqs[0] > EVENTS - KEEP
    joined = [e for e in events if e["kind"] == "node_joined"]
    assert [(e["seq"], e["fields"]["node"]) for e in joined] == [(EVENTS + 2, "node-a")]  # after its own:
    assert [e["seq"] for e in events if e["kind"] == "coordinator_leads"] == [EVENTS + 1]

    time.sleep(3)  # a few more periodic passes: the leadership holds
    assert leads_with_node_a()
    log = trainerd.log()
    assert "lost leadership" not in log and "standing down" not in log, log[-3000:]
    assert "old event(s) deleted" in log
