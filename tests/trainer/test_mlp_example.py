"""The built-in example job as real MindSpore processes on the CPU, launched the way the agent does:
no msrun, one scheduler and two workers, each given the dynamic-cluster environment by hand."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from proto.progress_datagram import ProgressMessage, StepReport, WorkerEvent
from tests.harness import Processes
from tests.ports import free_port
from tests.trainer.mlp_runs import GLOBAL_BATCH, Run, cluster_env, run_example, run_standalone

pytestmark = pytest.mark.mindspore  # MindSpore processes: left out of `make test-fast`

STEPS = 30
WORLD_SIZE = 2


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    root = tmp_path_factory.mktemp("data_parallel")
    processes = Processes(root)
    try:
        envs = cluster_env(root / "progress.sock", free_port())
        argv = ["--steps", str(STEPS), "--seed", "7", "--output", str(root / "out")]
        procs, reports = asyncio.run(run_example(processes, root, envs, argv))
        yield Run(procs, reports, root / "out", processes.logs())
    finally:
        processes.cleanup()


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Run]]:
    """The same job run twice by hand: one process, no cluster, the flags instead of the launcher's batch."""
    root = tmp_path_factory.mktemp("standalone")
    processes = Processes(root)
    try:
        argv = ["--steps", str(STEPS), "--seed", "7", "--global-batch", str(GLOBAL_BATCH), "--micro-batch", "16"]
        yield [run_standalone(processes, root, f"standalone{attempt}", argv) for attempt in range(2)]
    finally:
        processes.cleanup()


def test_every_process_exits_zero(data_parallel: Run) -> None:
    codes = {name: proc.wait(timeout=1) for name, proc in data_parallel.procs.items()}
    assert codes == {"scheduler": 0, "rank0": 0, "rank1": 0}, data_parallel.logs


def test_ranks_end_with_bit_identical_weights(data_parallel: Run) -> None:
    rank0, rank1 = data_parallel.weights(0), data_parallel.weights(1)
    assert sorted(rank0) == sorted(rank1) == ["hidden.bias", "hidden.weight", "out.bias", "out.weight"]
    for name in rank0:
        assert rank0[name].tobytes() == rank1[name].tobytes(), f"{name} differs between the ranks"


def test_each_rank_reports_its_steps_then_finished(data_parallel: Run) -> None:
    """Step reports are fire-and-forget (a full agent queue drops some); `finished` always arrives."""
    for rank in range(WORLD_SIZE):
        steps = data_parallel.steps(rank)
        numbers = [s.step for s in steps]
        assert numbers and numbers == sorted(set(numbers)) and set(numbers) <= set(range(1, STEPS + 1)), numbers
        assert [s.consumed_samples for s in steps] == [GLOBAL_BATCH * n for n in numbers]
        assert {(s.job, s.generation) for s in steps} == {("mlp", 1)}
        events = data_parallel.events(rank)
        assert [(e.event, e.step) for e in events] == [(WorkerEvent.STARTED, 0), (WorkerEvent.FINISHED, STEPS)]
        assert data_parallel.reports.index(events[-1]) > data_parallel.reports.index(steps[-1])


def test_loss_decreases_and_every_rank_sees_the_same_gradient_norm(data_parallel: Run) -> None:
    for rank in range(WORLD_SIZE):
        losses = [s.loss for s in data_parallel.steps(rank)]
        assert losses[-1] < 0.8 * losses[0], losses
    norms = [{s.step: s.grad_norm for s in data_parallel.steps(rank)} for rank in range(WORLD_SIZE)]
    common = norms[0].keys() & norms[1].keys()
    assert common and all(norms[0][step] == norms[1][step] for step in common)


def test_ranks_split_each_global_batch_like_one_process_would(data_parallel: Run, standalone: list[Run]) -> None:
    """Each rank trains on its own half of the global batch: before any update, the ranks' mean loss
    and the all-reduced gradient norm equal those of one process taking the whole batch."""
    firsts = [run.steps(rank)[0] for run, rank in [(standalone[0], 0), (data_parallel, 0), (data_parallel, 1)]]
    # Step 1 follows a second of compilation, so the agent's queue is empty and it is never dropped.
    assert [first.step for first in firsts] == [1, 1, 1]
    alone, *ranks = firsts
    assert np.mean([r.loss for r in ranks]) == pytest.approx(alone.loss, rel=1e-6)
    assert ranks[0].grad_norm == pytest.approx(alone.grad_norm, rel=1e-5)


def test_same_seed_same_weights(standalone: list[Run]) -> None:
    assert [run.procs[f"standalone{i}"].wait(timeout=1) for i, run in enumerate(standalone)] == [0, 0]
    first, second = (run.weights(0) for run in standalone)
    for name in first:
        assert first[name].tobytes() == second[name].tobytes(), f"{name} differs between two runs with one seed"


def test_sigterm_ends_a_worker_at_once(tmp_path: Path) -> None:
    """The agent's Stop is a SIGTERM: a worker must go promptly, even while its peer still trains."""
    processes = Processes(tmp_path)
    try:
        envs = cluster_env(tmp_path / "progress.sock", free_port())

        def both_ranks_training(reports: list[ProgressMessage]) -> bool:
            return {m.rank for m in reports if isinstance(m, StepReport) and m.step >= 3} == {0, 1}

        procs, _ = asyncio.run(run_example(processes, tmp_path, envs, ["--steps", "1000000"],
                                           until=both_ranks_training))
        sent = time.monotonic()
        procs["rank1"].signal(signal.SIGTERM)
        assert procs["rank1"].wait(timeout=10) == -signal.SIGTERM
        assert time.monotonic() - sent < 2
    finally:
        processes.cleanup()
