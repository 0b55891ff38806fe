"""A rank slow to reach its first collective, under real trainerd, agents and MindSpore workers on the CPU, in
both examples (the MLP's own step loop, the Transformer's Model.train).

Rank 1 sleeps before its first step (`--slow-start 1:20`), and MS_CPU_COMM_OP_TIMEOUT=5 makes rank 0's first
AllReduce give up waiting for it. That is the cluster's trouble, not an error of the job's: the job is not
FAILED; it recovers, the failure names rank 1 as the rank that reached no collective (rank 0, which waited,
is not blamed), and the relaunch (which does not sleep) COMPLETES.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from proto import trainerd_pb2 as pb
from proto import trainerd_pb2_grpc as pb_grpc
from tests.harness import Processes
from tests.integration.test_recovery import recovery_job, start_trainerd
from tests.integration.test_transformer_example import GLOBAL_BATCH, transformer_job
from tests.waiting import wait_until

STEPS = 30


def job_status(control: pb_grpc.ControlStub) -> pb.JobStatus | None:
    """The job's status, asked in-process; None while the coordinator cannot answer."""
    try:
        reply = control.GetStatus(pb.StatusRequest(), timeout=5)
    except grpc.RpcError:
        return None
    return reply.job if reply.HasField("job") else None


def all_events(control: pb_grpc.ControlStub) -> list[pb.Event]:
    return list(control.ListEvents(pb.EventsRequest(after_seq=0, limit=500), timeout=10).events)


@pytest.mark.parametrize("example", ["mlp", "transformer_lm"])
def test_a_rank_slow_to_its_first_collective_is_named_and_the_job_recovers_and_completes(
        tmp_path: Path, procs: Processes, example: str) -> None:
    settings = dict(env={"MS_CPU_COMM_OP_TIMEOUT": "5"}, restart={"max": 3, "backoff_s": 0.2})
    if example == "mlp":
        entrypoint = ["{python}", "-m", "trainer.examples.mlp", "--steps", str(STEPS), "--output",
                      str(tmp_path / "out"), "--slow-start", "1:20"]
        job = recovery_job(tmp_path, steps=STEPS, nodes=(2, 2), global_batch=32, micro_batch=16,
                           entrypoint=entrypoint, **settings)
    else:
        job = transformer_job(tmp_path, STEPS, (2, 2), GLOBAL_BATCH // 2, "--slow-start", "1:20", **settings)
    address = start_trainerd(tmp_path, procs, job)
    for i in range(2):
        procs.agent(f"n{i}", address)
    with grpc.insecure_channel(address) as channel:
        control = pb_grpc.ControlStub(channel)
        done = wait_until(lambda: (j := job_status(control)) and j.state in ("COMPLETED", "FAILED") and j, 300,
                          "the job to end", interval=1.0, on_timeout=procs.logs)
        events = all_events(control)
    shown = "\n".join(f"{e.kind}: {e.message}" for e in events)
    assert done.state == "COMPLETED" and done.step == STEPS, f"{done}\n{shown}"
    recoveries = [e for e in events if e.kind == "recovery_started"]
    assert recoveries and "rank 1 on node n1 reached no collective" in recoveries[0].message, shown
    # The relaunch does not sleep, but on a loaded machine its first collective can still outwait the 5 s of
    # MS_CPU_COMM_OP_TIMEOUT this test sets (seen in CI with the Transformer's compile): the cluster's trouble
    # again, another recovery, never a FAILED job.
    assert done.generation == 1 + len(recoveries) and done.crash_restarts == len(recoveries), shown
    assert not [e for e in events if e.kind == "job_failed"], shown
    if done.generation == 2:
        failure = done.last_failure
        assert failure.cause == "process_exited", failure
        assert (failure.rank, failure.node) == (1, "n1"), failure
        assert "rank 1 on node n1 reached no collective" in failure.message, failure
