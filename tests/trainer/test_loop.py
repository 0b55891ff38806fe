"""A training loop of the script's own with TrainerdLoop (loop_job.py), run as real MindSpore processes the way
the agent launches them, reporting to a real progress receiver: every step reported, checkpoints on the schedule
that verify, each epoch reading the next epoch of the sample stream (not the first one again, as a `for` over the
dataset per epoch would), a resume in the middle of an epoch that trains the same samples and ends with the
same weights as the uninterrupted run, a NaN batch that the guard keeps out of the weights and reports, and a
validation pass each epoch that tells the agent the rank evaluates."""

from __future__ import annotations

import asyncio
import math
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from proto.progress_datagram import BadBatchReason, BadBatchReport, WorkerEvent
from tests.harness import Processes
from tests.trainer.mlp_runs import Run, run_example
from tests.trainer.test_callback import one_rank_env, own_dataset_env, same, step_dir
from trainer.checkpoint import verify_checkpoint

pytestmark = pytest.mark.mindspore  # MindSpore processes: left out of `make test-fast`

JOB = [sys.executable, str(Path(__file__).with_name("loop_job.py"))]
EPOCHS, STEPS_PER_EPOCH, EVERY = 3, 4, 5
STEPS = EPOCHS * STEPS_PER_EPOCH


@pytest.fixture(scope="module")
def processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
    procs = Processes(tmp_path_factory.mktemp("loop"))
    try:
        yield procs
    finally:
        procs.cleanup()


def run_loop(processes: Processes, root: Path, name: str, generation: int = 1, *flags: str,
             **env: str) -> tuple[Run, list[str]]:
    """loop_job.py on one rank, checkpoints every 5 steps; the run and, per step, its epoch and samples. With
    --own-dataset the job sets no batch split (the script batches its own dataset)."""
    argv = ["--epochs", str(EPOCHS), "--steps-per-epoch", str(STEPS_PER_EPOCH), "--samples-file",
            str(root / "samples.txt"), "--output", str(root / "out"), *flags]
    envs = own_dataset_env(root, name, TRAINERD_GENERATION=str(generation), **env) if "--own-dataset" in flags \
        else one_rank_env(root, name, generation, **env)
    procs, reports = asyncio.run(run_example(processes, root, envs, argv, command=JOB))
    run = Run(procs, reports, root / "out", processes.logs())
    assert run.exit_codes() == {name: 0}, run.logs
    return run, (root / "samples.txt").read_text().splitlines()


@pytest.fixture(scope="module")
def reference(processes: Processes, tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, list[str], Path]:
    root = tmp_path_factory.mktemp("reference")
    return (*run_loop(processes, root, "reference"), root)


def test_every_step_is_reported_and_the_scheduled_checkpoints_verify(reference: tuple[Run, list[str], Path]) -> None:
    run, _, root = reference
    assert [s.step for s in run.steps(0)] == list(range(1, STEPS + 1))
    assert [s.epoch for s in run.steps(0)] == [e for e in range(1, EPOCHS + 1) for _ in range(STEPS_PER_EPOCH)]
    assert [e.event for e in run.events(0)] == [WorkerEvent.STARTED, WorkerEvent.FINISHED]
    assert [c.step for c in run.checkpoints()] == [EVERY, 2 * EVERY]
    for step in (EVERY, 2 * EVERY):
        verify_checkpoint(step_dir(root, step))


def test_each_epoch_reads_the_next_epoch_of_the_stream(reference: tuple[Run, list[str], Path]) -> None:
    _, samples, _ = reference
    epochs = {epoch: set() for epoch in range(1, EPOCHS + 1)}
    for line in samples:
        epoch, *values = line.split()
        epochs[int(epoch)].update(values)
    assert all(len(read) == STEPS_PER_EPOCH * 32 for read in epochs.values())  # 4 steps of the global batch
    assert not (epochs[1] & epochs[2]) and not (epochs[2] & epochs[3]) and not (epochs[1] & epochs[3])


def test_a_resume_inside_an_epoch_trains_the_same_samples_to_the_same_weights(
        processes: Processes, reference: tuple[Run, list[str], Path], tmp_path: Path) -> None:
    reference_run, reference_samples, reference_root = reference
    shutil.copytree(step_dir(reference_root, EVERY), step_dir(tmp_path, EVERY))
    run, samples = run_loop(processes, tmp_path, "resumed", generation=2,
                            TRAINERD_RESUME_FROM=str(step_dir(tmp_path, EVERY)))
    assert [s.step for s in run.steps(0)] == list(range(EVERY + 1, STEPS + 1))
    assert samples == reference_samples[EVERY:]  # epoch 2 from its second step on, then epoch 3
    assert same(run.weights(0), reference_run.weights(0))


def test_a_dataset_of_the_scripts_own_resumes_at_its_step_inside_the_epoch_to_the_same_weights(
        processes: Processes, tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("own_dataset")
    whole, whole_samples = run_loop(processes, root, "whole", 1, "--own-dataset")
    assert [(s.step, s.epoch) for s in whole.steps(0)] == [
        (n, (n - 1) // STEPS_PER_EPOCH + 1) for n in range(1, STEPS + 1)]
    resumed_root = tmp_path_factory.mktemp("own_dataset_resumed")
    shutil.copytree(step_dir(root, EVERY), step_dir(resumed_root, EVERY))
    run, samples = run_loop(processes, resumed_root, "resumed", 2, "--own-dataset",
                            TRAINERD_RESUME_FROM=str(step_dir(resumed_root, EVERY)))
    assert [(s.step, s.epoch) for s in run.steps(0)] == [
        (n, (n - 1) // STEPS_PER_EPOCH + 1) for n in range(EVERY + 1, STEPS + 1)]
    assert samples == whole_samples[EVERY:]  # the in-order dataset: epoch 2 from its second step on, then epoch 3
    assert same(run.weights(0), whole.weights(0))


def test_a_nan_batch_is_kept_out_of_the_weights_reported_and_the_run_goes_on(
        processes: Processes, reference: tuple[Run, list[str], Path], tmp_path: Path) -> None:
    run, _ = run_loop(processes, tmp_path, "nan", 1, "--nan-step", "3")
    (report,) = [m for m in run.reports if isinstance(m, BadBatchReport)]
    assert (report.step, report.sample_start, report.sample_end) == (3, 64, 96)  # the third global batch of 32
    assert report.reason in (BadBatchReason.NONFINITE_LOSS, BadBatchReason.NONFINITE_GRAD_NORM)
    steps = run.steps(0)
    assert [s.step for s in steps] == list(range(1, STEPS + 1))
    assert all(math.isfinite(s.loss) for s in steps if s.step != 3)
    assert all(np.isfinite(weights).all() for weights in run.weights(0).values())
    assert not same(run.weights(0), reference[0].weights(0))  # the step's update was left out, not made


def test_a_validation_pass_between_epochs_tells_the_agent_the_rank_evaluates_and_changes_nothing(
        processes: Processes, reference: tuple[Run, list[str], Path], tmp_path: Path) -> None:
    run, samples = run_loop(processes, tmp_path, "valid", 1, "--valid")
    assert run.logs.count("validation accuracy") == EPOCHS, run.logs
    events = [(e.event, e.step) for e in run.events(0)]
    assert events == [(WorkerEvent.STARTED, 0), *((WorkerEvent.EVALUATING, STEPS_PER_EPOCH * epoch)
                                                   for epoch in range(1, EPOCHS + 1)), (WorkerEvent.FINISHED, STEPS)]
    assert samples == reference[1] and same(run.weights(0), reference[0].weights(0))
