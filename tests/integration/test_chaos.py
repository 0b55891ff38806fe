"""Chaos on the cluster in a box (tests/cluster_box): hosts in network namespaces, a 3-member etcd, two
coordinators over mutual TLS, real agents and real MindSpore on the CPU, data parallel across hosts.

Cut and heal: a host's link goes down mid-run (no connection is reset, as when a switch port dies). It
is LOST within heartbeat.timeout_s + 1 s, the job goes on with the other two, the cut-off host stops
its own training processes within timeout_s + stop_grace_s (self-fencing: nobody can tell it to), and
once the link is back the host passes job.node_check, rejoins and the job grows back to three; the
job completes.
"""

from __future__ import annotations

import json

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.cluster_box.box import ClusterBox
from tests.ports import free_port
from tests.waiting import wait_until

STOP_GRACE_S = 3.0


@pytest.fixture
def cluster_box(tmp_path: Path) -> Iterator[Callable[..., ClusterBox]]:
    """Opens boxes for a test; each is closed after it, whatever the test did."""
    boxes: list[ClusterBox] = []

    def open_box(**options) -> ClusterBox:
        box = ClusterBox(tmp_path, **options)
        boxes.append(box)
        return box.__enter__()

    yield open_box
    for box in boxes:
        box.close()


def mlp_job(box: ClusterBox, *, steps: int) -> dict:
    return {
        "name": "mlp",
        "entrypoint": ["{python}", "-m", "trainer.examples.mlp", "--steps", str(steps),
                       "--output", str(box.root / "out")],
        "min_nodes": 2, "max_nodes": 3, "global_batch": 96, "micro_batch": 16,
        "scheduler_port": free_port(), "stop_grace_s": STOP_GRACE_S, "start_wait_s": 60,
        "checkpoint": {"dir": str(box.checkpoint_dir), "every_steps": 50, "keep": 3},
        "node_check": ["{python}", "-c", "print('devices healthy')"],
    }


class Timeline:
    """When each phase was reached, printed at the end (pytest -s) to see where a run's time goes."""

    def __init__(self) -> None:
        self._start = time.monotonic()
        self.marks: list[tuple[str, float]] = []

    def mark(self, what: str, step: int | None = None) -> None:
        self.marks.append((what if step is None else f"{what} (step {step})", time.monotonic() - self._start))

    def __str__(self) -> str:
        return ", ".join(f"{what} at {at:.1f}s" for what, at in self.marks)


def test_a_cut_host_is_lost_fences_itself_and_regrows_into_the_job_after_healing(cluster_box) -> None:
    steps = 800
    timeline = Timeline()
    box = cluster_box(hosts=3, job=lambda b: mlp_job(b, steps=steps))
    timeline.mark("box up")
    timeout_s = box.heartbeat_timeout_s
    job = wait_until(lambda: (j := box.job()) and j.world_size == 3 and j.state == "RUNNING"
                     and j.last_checkpoint_step >= 50 and j, 180, "3 ranks past the first checkpoint",
                     interval=0.5, on_timeout=box.procs.logs)
    timeline.mark("3 ranks running", job.step)
    victim = box.host(next(r.node for r in job.ranks if r.rank == 2))  # not the scheduler's host
    assert victim.workers(), f"no training process on {victim.name}"

    box.cut(victim)
    cut_at = time.monotonic()
    wait_until(lambda: box.node_states().get(victim.name) == "LOST", timeout_s + 1, f"{victim.name} LOST",
               interval=0.05, on_timeout=box.procs.logs)
    lost_s = time.monotonic() - cut_at
    wait_until(lambda: not victim.processes(), timeout_s + STOP_GRACE_S, f"{victim.name}'s processes gone",
               interval=0.05, on_timeout=box.procs.logs)
    fenced_s = time.monotonic() - cut_at
    print(f"cut {victim.name}: LOST after {lost_s:.2f}s, its processes gone after {fenced_s:.2f}s")
    timeline.mark("cut host fenced")
    assert "fencing generation 1" in victim.agent.log()

    job = wait_until(lambda: (j := box.job()) and j.generation == 2 and j.world_size == 2 and j.state == "RUNNING"
                     and j, 120, "generation 2 on the other 2 hosts", interval=0.5, on_timeout=box.procs.logs)
    assert job.last_failure.cause == "node_lost" and job.last_failure.node == victim.name
    assert job.crash_restarts == 0
    timeline.mark("2 ranks running", job.step)

    box.heal(victim)
    wait_until(lambda: box.node_states().get(victim.name) == "READY", 30, f"{victim.name} READY again",
               on_timeout=box.procs.logs)
    timeline.mark("healed host READY")
    job = wait_until(lambda: (j := box.job()) and j.generation == 3 and j.world_size == 3 and j, 180,
                     "generation 3 on 3 hosts", interval=0.5, on_timeout=box.procs.logs)
    timeline.mark("3 ranks again", job.step)
    job = wait_until(lambda: (j := box.job()) and j.state in ("COMPLETED", "FAILED") and j, 300, "the end",
                     interval=0.5, on_timeout=box.procs.logs)
    timeline.mark("the end")
    print(timeline)
    assert job.state == "COMPLETED", job
    assert job.step == steps and job.generation == 3
    events = box.events()
    assert [victim.name in e.message for e in events if e.kind == "node_lost"] == [True]
    kinds = [e.kind for e in events if victim.name in e.message]
    assert kinds.index("node_check_started") < kinds.index("node_check_passed"), kinds  # before it got work
    all_kinds = [e.kind for e in events]
    assert "checkpoint_requested" in all_kinds and "reshape_started" in all_kinds  # grown back at a checkpoint
    resumed = [json.loads(e.fields_json)["resume_step"] for e in events if e.kind == "generation_started"]
    assert resumed[0] == 0 and 50 <= resumed[1] < resumed[2], resumed  # 3 -> 2 resharded from a checkpoint, 2 -> 3


def test_the_etcd_leader_killed_mid_run_costs_at_most_one_restart(cluster_box) -> None:
    steps = 600
    box = cluster_box(hosts=2, job=lambda b: {**mlp_job(b, steps=steps), "min_nodes": 2, "max_nodes": 2})
    assert box.etcd is not None
    wait_until(lambda: (j := box.job()) and j.state == "RUNNING" and j.last_checkpoint_step >= 50, 180,
               "running past the first checkpoint", interval=0.5, on_timeout=box.procs.logs)
    leader = box.etcd.leader()
    assert leader is not None
    box.etcd.kill(leader)
    wait_until(lambda: (new := box.etcd.leader()) is not None and new is not leader, 30, "a new etcd leader")
    job = wait_until(lambda: (j := box.job()) and j.state in ("COMPLETED", "FAILED") and j, 300, "the end",
                     interval=0.5, on_timeout=box.procs.logs)
    assert job.state == "COMPLETED", job
    assert job.step == steps and job.restarts <= 1, job
    print(f"etcd leader {leader.name} killed: {job.restarts} restart(s)")
    box.etcd.restart(leader)  # the member comes back and rejoins: three agree on a leader again
    wait_until(lambda: box.etcd.leader() is not None and all(m.alive for m in box.etcd.members), 30,
               "three etcd members again")


def test_a_slow_and_stalling_link_is_no_loss_at_the_default_timeouts(cluster_box) -> None:
    """300 ms each way and a 1.5 s stall every 3 s, for 15 s, on the agent's path: the node stays READY,
    and the agent keeps its session (no acknowledgement waits out the 5 s timeout: nothing is fenced)."""
    box = cluster_box(hosts=1, heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0)
    host = box.hosts[0]
    host.delay(0.3)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        host.stall(1.5)
        for _ in range(6):
            assert box.node_states().get(host.name) == "READY"
            time.sleep(0.5)
    host.pass_through()
    assert "no answer from the coordinator" not in host.agent.log()
    assert [e.kind for e in box.events() if e.kind == "node_lost"] == []
