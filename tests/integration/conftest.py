"""Fixtures of the integration tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster_box.box import ClusterBox
from tests.harness import Processes

REFERENCE_STEPS = 600


@pytest.fixture
def procs(tmp_path: Path):
    processes = Processes(tmp_path)
    yield processes
    processes.cleanup()


@pytest.fixture
def cluster_box(tmp_path: Path) -> Iterator[Callable[..., ClusterBox]]:
    """Opens cluster boxes (tests/cluster_box) for a test; each is closed after it, whatever the test did."""
    boxes: list[ClusterBox] = []

    def open_box(**options) -> ClusterBox:
        box = ClusterBox(tmp_path, **options)
        boxes.append(box)
        return box.__enter__()

    yield open_box
    for box in boxes:
        box.close()


@dataclass(frozen=True)
class FaultFreeRun:
    root: Path  # the final weights are in root/out
    job: dict   # its status when it ended (`status -o json`'s job)
    training_processes_left: list[str]  # those still running 15 s after the end (none, if all went well)


@pytest.fixture(scope="session")
def fault_free_mlp(tmp_path_factory: pytest.TempPathFactory) -> FaultFreeRun:
    """The MLP example of test_job_launch (2 ranks on trainerd's two local agents) for REFERENCE_STEPS,
    run once per session without faults: test_job_launch checks the run, and test_chaos compares the final
    weights of the same job run through faults with its (where the hosts are does not change what they
    compute). Nothing of it runs on once it has ended."""
    from tests.integration.test_job_launch import mlp_job, start_cluster, training_processes, wait_for_state

    root = tmp_path_factory.mktemp("fault-free-mlp")
    processes = Processes(root)
    try:
        address = start_cluster(root, processes, mlp_job(root, steps=REFERENCE_STEPS))
        job = wait_for_state(address, {"COMPLETED", "FAILED"}, 180, processes)
        deadline = time.monotonic() + 15
        while (left := training_processes(root)) and time.monotonic() < deadline:
            time.sleep(0.2)
        return FaultFreeRun(root, job, [" ".join(p.cmdline()) for p in left])
    finally:
        processes.cleanup()
