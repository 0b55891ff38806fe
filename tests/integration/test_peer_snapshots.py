"""In-memory snapshots across hosts on the cluster in a box (tests/cluster_box): each agent holds its own
ranks' snapshot files in shared memory and a copy of its ring predecessor's, served to one another over
mutual TLS (agent/snapshots/peer_service.py); real MindSpore, data parallel over three hosts.

One run, two faults:
- A host dies (link down, agent and workers killed, its shared memory gone): the job resumes on the other
  two from the in-memory snapshot, its dead host's ranks read from the copies on its ring successor,
  resharded 3 -> 2; it loses at most two snapshot intervals (the newest snapshot may still have been on its
  way to the successor when the host died), where a disk checkpoint would have cost hundreds of steps.
- Once the host is back and the job has grown to three again, two ring neighbours die together: the first's
  ranks were held only by those two, so no complete snapshot survives, the job falls back to the newest disk
  checkpoint on the one host left, the events say why, and it completes.
"""

from __future__ import annotations

import json

from tests.cluster_box.box import ClusterBox
from tests.integration.test_chaos import Timeline, mlp_job
from tests.waiting import wait_until
from trainer.checkpoint import verify_checkpoint
from trainer.checkpoint.step_dirs import list_checkpoints

MEMORY_EVERY = 50
DISK_EVERY = 2000  # far apart: the disk checkpoints are the ones a reshape asks for


def node_order(job) -> list[str]:
    """The generation's nodes in rank order (the ring the agents copy along)."""
    order: list[str] = []
    for slot in sorted(job.ranks, key=lambda r: r.rank):
        if slot.node not in order:
            order.append(slot.node)
    return order


def test_a_dead_host_costs_a_snapshot_interval_and_two_dead_neighbours_fall_back_to_disk(cluster_box) -> None:
    # On an idle machine the last fault came at step ~800 and the one rank left trained the rest at ~130 steps a
    # second; the floor keeps a faster machine from running out of steps before the faults.
    steps = 1300
    timeline = Timeline()

    def job(box: ClusterBox) -> dict:
        base = mlp_job(box, steps=steps, min_step_ms=10)
        return {**base, "min_nodes": 1, "max_nodes": 3,
                "checkpoint": {**base["checkpoint"], "every_steps": DISK_EVERY, "memory_every_steps": MEMORY_EVERY}}

    box = cluster_box(hosts=3, job=job)
    timeline.mark("box up")
    # Hosts join one by one, so the job may have started on two and grown to three at a disk checkpoint it was
    # asked for: wait until the three-rank generation has snapshots newer than that checkpoint, copied.
    running = wait_until(lambda: (j := box.job()) and j.world_size == 3 and j.state == "RUNNING" and j.step >= 300
                         and j.step >= max(j.last_checkpoint_step, 0) + 3 * MEMORY_EVERY and j, 180,
                         "3 ranks past step 300, three snapshot intervals past the disk checkpoint", interval=0.2,
                         on_timeout=box.procs.logs)
    assert running.step < DISK_EVERY - 200, f"too fast to test: step {running.step} already"
    timeline.mark("3 ranks running", running.step)
    first = running.generation

    # One host dies: resumed from memory, its ranks from its ring successor's copies.
    victim = box.host(next(r.node for r in running.ranks if r.rank == 2))  # not the scheduler's host
    box.kill_host(victim)
    job_after = wait_until(lambda: (j := box.job()) and j.generation > first and j.world_size == 2
                           and j.state == "RUNNING" and j, 120, "a generation on the other 2 hosts",
                           interval=0.2, on_timeout=box.procs.logs)
    timeline.mark("2 ranks running", job_after.step)
    recovery = job_after.last_recovery
    print(f"host {victim.name} killed: resumed from {recovery.resumed_from} step {recovery.resumed_from_step}, "
          f"{recovery.lost_steps} steps lost, last disk checkpoint {job_after.last_checkpoint_step}")
    assert job_after.last_failure.cause == "node_lost" and job_after.last_failure.node == victim.name
    assert recovery.resumed_from == "memory", recovery
    assert recovery.lost_steps <= 2 * MEMORY_EVERY, recovery
    assert recovery.resumed_from_step > max(job_after.last_checkpoint_step, 0) + MEMORY_EVERY, recovery
    survivors = [h for h in box.hosts if h is not victim]
    assembled = [line for h in survivors for line in h.agent.log().splitlines()
                 if f"assembled the in-memory snapshot of step {recovery.resumed_from_step} (world size 3)" in line]
    assert len(assembled) == 2, assembled
    assert any(" 0 of its ranks fetched" not in line for line in assembled), assembled  # something crossed hosts

    # The host comes back, empty, and the job grows to three again.
    box.heal(victim)
    box.start_agent(victim)
    regrown = wait_until(lambda: (j := box.job()) and j.world_size == 3 and j.state == "RUNNING"
                         and j.generation > job_after.generation and j, 180, "3 ranks again", interval=0.2,
                         on_timeout=box.procs.logs)
    timeline.mark("3 ranks again", regrown.step)
    moving = wait_until(lambda: (j := box.job()) and j.step >= regrown.step + 4 * MEMORY_EVERY and j, 120,
                        "snapshots of the regrown generation", interval=0.2, on_timeout=box.procs.logs)
    assert moving.generation == regrown.generation and moving.step < steps - 200, moving

    # Two ring neighbours die together: the first one's ranks were only on those two.
    order = node_order(moving)
    dead = [box.host(order[1]), box.host(order[2])]  # order[0], the scheduler's host, survives
    for host in dead:
        box.kill_host(host)
    last = wait_until(lambda: (j := box.job()) and j.generation > moving.generation and j.world_size == 1
                      and j.state == "RUNNING" and j, 120, "a generation on the one host left", interval=0.2,
                      on_timeout=box.procs.logs)
    timeline.mark("1 rank running", last.step)
    assert last.last_recovery.resumed_from == "disk", last.last_recovery
    started = [e for e in box.events() if e.kind == "generation_started"
               and json.loads(e.fields_json).get("generation") == last.generation]
    assert started and "no complete in-memory snapshot survives" in started[0].message, started
    # whose ranks were lost with whom: the first's, held by the two dead hosts (the coordinator names those
    # that reported holding the newest step)
    assert "ranks 1 of step" in started[0].message and any(h.name in started[0].message for h in dead), started
    assert order[0] not in started[0].message.split("held only by")[-1], started[0].message

    end = wait_until(lambda: (j := box.job()) and j.state in ("COMPLETED", "FAILED") and j, 400, "the end",
                     interval=0.5, on_timeout=box.procs.logs)
    timeline.mark("the end")
    print(timeline)
    assert end.state == "COMPLETED" and end.step == steps, end
    for checkpoint in list_checkpoints(box.checkpoint_dir):
        assert checkpoint.complete, checkpoint
        verify_checkpoint(checkpoint.path)
