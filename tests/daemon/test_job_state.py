"""Every write of the job state goes through the transition table."""

from dataclasses import replace

import pytest

from daemon.job.state import (
    ALLOWED_TRANSITIONS,
    Failure,
    FailureCause,
    IllegalTransition,
    JobRecord,
    communication_error,
)
from proto.vocabulary import JobState


def test_every_state_has_a_row_and_completed_only_starts_again() -> None:
    assert set(ALLOWED_TRANSITIONS) == set(JobState)
    for state in set(JobState) - {JobState.COMPLETED, JobState.RECOVERING, JobState.PENDING}:
        with pytest.raises(IllegalTransition, match="job cannot go from COMPLETED"):
            JobRecord(JobState.COMPLETED).moved_to(state)


def test_allowed_and_refused_moves() -> None:
    record = JobRecord(JobState.PENDING)
    running = record.moved_to(JobState.RUNNING, generation=1, world_size=2)
    assert (running.state, running.generation, running.world_size) == (JobState.RUNNING, 1, 2)
    failed = running.moved_to(JobState.FAILED, last_failure=Failure(FailureCause.PROCESS_EXITED, "rank 1 exited"))
    assert failed.last_failure.message == "rank 1 exited"
    with pytest.raises(IllegalTransition, match="from FAILED to RUNNING"):
        failed.moved_to(JobState.RUNNING)
    assert running.moved_to(JobState.RUNNING) == running  # staying put is always allowed


def test_record_round_trips_through_json() -> None:
    record = JobRecord(JobState.FAILED, 3, 4, 1, Failure(FailureCause.NODE_LOST, "node b lost", "b", -1, 0, 0))
    assert JobRecord.from_json(record.to_json()) == record
    asked = JobRecord(JobState.RUNNING, 3, 4, exit_requested_generation=3)
    assert JobRecord.from_json(asked.to_json()) == asked
    older = {k: v for k, v in asked.to_json().items() if k != "exit_requested_generation"}
    assert JobRecord.from_json(older).exit_requested_generation == 0
    script = JobRecord(JobState.RUNNING, 2, 2, steps_from_output=True)
    assert JobRecord.from_json(script.to_json()) == script
    older = {k: v for k, v in script.to_json().items() if k != "steps_from_output"}
    assert JobRecord.from_json(older).steps_from_output is False


def test_failure_cause_is_stored_as_its_plain_name_and_read_back_strictly() -> None:
    failure = Failure(FailureCause.USAGE_ERROR, "rank 0 exited with code 2", "a", 0, 2)
    assert failure.to_json()["cause"] == "usage_error"
    assert Failure.from_json(failure.to_json()).cause is FailureCause.USAGE_ERROR
    with pytest.raises(ValueError, match="'crashed' is not a valid FailureCause"):
        Failure.from_json({**failure.to_json(), "cause": "crashed"})


def test_launch_usage_job_and_data_errors_are_permanent_and_they_a_lost_node_lost_processes_and_a_device_fault_spare_the_budget(
        ) -> None:
    assert {c for c in FailureCause if not c.spends_budget} == {
        FailureCause.NODE_LOST, FailureCause.PROCESSES_GONE, FailureCause.FENCED, FailureCause.JOB_ERROR,
        FailureCause.DEVICE_FAULT,
        FailureCause.BAD_DATA, FailureCause.LAUNCH_FAILED, FailureCause.USAGE_ERROR}
    assert {c for c in FailureCause if c.permanent} == {FailureCause.LAUNCH_FAILED, FailureCause.USAGE_ERROR,
                                                        FailureCause.JOB_ERROR, FailureCause.BAD_DATA}


def test_a_failure_stored_before_it_had_a_location_reads_back_with_none() -> None:
    failure = Failure(FailureCause.JOB_ERROR, "rank 0 exited with code 1: KeyError: 'x' (train.py:3)", "a", 0, 1,
                      location="train.py:3")
    assert Failure.from_json(failure.to_json()) == failure
    older = {k: v for k, v in failure.to_json().items() if k != "location"}
    assert Failure.from_json(older).location == ""


def test_where_a_failure_was_blamed_survives_etcd_and_a_record_from_before_blames_no_node() -> None:
    failure = Failure(FailureCause.PROCESS_EXITED, "rank 1 exited with code 1: ValueError: x", "b", 1, 1,
                      location="train.py:9", error="ValueError: x", same_error_ranks=(1,), samples_at=132,
                      blamed_node="b", blamed=2, error_kind="python_exception")
    assert Failure.from_json(failure.to_json()) == failure  # a new leader moves the rank, and forgives, alike
    older = {k: v for k, v in failure.to_json().items() if k not in ("samples_at", "blamed_node", "blamed", "error_kind")}
    assert (Failure.from_json(older).samples_at, Failure.from_json(older).blamed_node,
            Failure.from_json(older).blamed) == (-1, "", 0)


def test_a_free_retry_survives_etcd_spending_no_budget_and_a_record_from_before_had_none() -> None:
    failure = Failure(FailureCause.PROCESS_EXITED, "rank 0 exited with code 1: OSError: x; ranks 0, 1 failed the same "
                      "way before any progress", "a", 0, 1, error="OSError: x", same_error_ranks=(0, 1),
                      free_retry=True)
    assert Failure.from_json(failure.to_json()) == failure  # a new leader fails the job if it comes again
    assert not failure.spends_budget and replace(failure, free_retry=False).spends_budget
    older = {k: v for k, v in failure.to_json().items() if k != "free_retry"}
    assert Failure.from_json(older).free_retry is False


@pytest.mark.parametrize("error, location, communication", [
    ("RuntimeError: Launch kernel failed: Default/AllReduce-op28", "train.py:24", True),
    ("RuntimeError: Launch kernel failed: Default/grad_reducer-DistributedGradReducer/AllReduce-op0", "train.py:24",
     True),
    ("Reduce wait receiving [const pair] failed.", "mindspore/ccsrc/cluster/rpc/core/collective_ops_impl.cc:201",
     True),
    ("Ring ReduceScatter wait sending [1,1] failed.", "", True),
    ("AllReduceCPUKernelMod launch failed.", "mindspore/ops/kernel/cpu/native/allreduce_cpu_kernel.cc:89", True),
    ("RuntimeError: The total number of timed out node is 1. Timed out node list is: [const vector]{1}",
     "train.py:11", True),
    ("RuntimeError: Connection reset by peer", "comm.py:80", True),
    ("ConnectionRefusedError: [Errno 111] Connection refused", "train.py:5", True),
    ("RuntimeError: EI0006: Getting socket times out. HCCL function error: HcclAllReduce", "train.py:8", True),
    ("RuntimeError: mccl AllReduce failed", "train.py:8", True),
    ("TimeoutError: timed out", "data.py:3", True),
    ("Failed to connect to the meta server node", "mindspore/ccsrc/cluster/topology/compute_graph_node.cc:99",
     True),
    ("FileNotFoundError: [Errno 2] No such file or directory: 'data/x'", "train.py:12", False),
    ("ValueError: operands could not be broadcast together with shapes (4,) (5,)", "train.py:30", False),
    ("KeyError: 'timeout'", "config.py:7", False),
    ("ModuleNotFoundError: No module named 'tokenizers'", "train.py:1", False),
])
def test_a_collective_or_a_connection_failing_is_told_by_its_root_cause(error, location, communication) -> None:
    assert communication_error(error, location) is communication
    assert Failure(FailureCause.PROCESS_EXITED, "", error=error, location=location).communication is communication
