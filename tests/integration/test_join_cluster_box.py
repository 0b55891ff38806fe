"""Three hosts in network namespaces (tests/cluster_box) joined by a token alone: no node file is made on the
head host or copied, each agent makes its key, gets its certificate from the coordinator and trains over mutual
TLS; a real MindSpore job spanning the three completes. Then one host is revoked: its session is closed and its
next dial refused."""

from __future__ import annotations

import stat

from tests.cluster_box.box import ClusterBox
from tests.integration.test_chaos import mlp_job
from tests.waiting import wait_until

STEPS = 200


def test_three_hosts_joined_by_token_complete_a_job_and_a_revoked_one_is_refused(cluster_box) -> None:
    def job(box: ClusterBox) -> dict:
        return {**mlp_job(box, steps=STEPS), "min_nodes": 3, "max_nodes": 3}

    box = cluster_box(hosts=3, job=job, join=True)
    pki = box.root / "pki"
    assert sorted(path.name for path in pki.iterdir()) == [
        "ca.crt", "ca.key", "coordinator.crt", "coordinator.key", "operator.crt", "operator.key"]
    for host in box.hosts:
        kept = host.work_dir / "tls"
        assert stat.S_IMODE((kept / "node.key").stat().st_mode) == 0o600
        assert "joined as node " + host.name in host.agent.log()

    ended = wait_until(lambda: (j := box.job()) and j.state in ("COMPLETED", "FAILED") and j, 300,
                       "the job ends", interval=0.5, on_timeout=box.procs.logs)
    assert ended.state == "COMPLETED", ended
    assert ended.world_size == 3 and ended.step == STEPS
    assert {rank.node for rank in ended.ranks} == {"h0", "h1", "h2"}

    victim = box.host("h2")
    assert "revoked" in box.revoke(victim)
    wait_until(lambda: "the certificate of node h2" in victim.agent.log() and "is revoked" in victim.agent.log(),
               30, "h2's next dial refused", on_timeout=box.procs.logs)
    wait_until(lambda: box.node_states().get("h2") == "LOST", 30, "h2 LOST", on_timeout=box.procs.logs)
    assert {box.node_states()[name] for name in ("h0", "h1")} == {"READY"}
