"""The example job's checkpoints with real MindSpore processes on the CPU: periodic and requested saves, each
reported only once committed, a kill and a resume that ends bit-identical to an uninterrupted run, resumes
at another world size, and the exit statuses of a resume that cannot be done."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from proto.exit_codes import EXIT_CHECKPOINT_UNREADABLE, EXIT_USAGE
from proto.progress_datagram import CheckpointReport, ProgressMessage, StepReport, WorkerEvent
from tests.harness import Processes
from tests.ports import free_port
from tests.trainer.mlp_runs import (
    EXAMPLE,
    FAST_START_ENV,
    GLOBAL_BATCH,
    RUN_TIMEOUT_S,
    Run,
    cluster_env,
    run_example,
    run_standalone,
)
from trainer.checkpoint import load_checkpoint, verify_checkpoint

pytestmark = pytest.mark.mindspore  # MindSpore processes: left out of `make test-fast`

STEPS = 30
SEED = 7
# By hand: one process that splits the global batch of 64 into 4 micro batches of 16.
BY_HAND = ["--seed", str(SEED), "--global-batch", str(GLOBAL_BATCH), "--micro-batch", "16"]
PARAMETERS = ["hidden.bias", "hidden.weight", "out.bias", "out.weight"]


class CommitWitness:
    """Looks, the moment each checkpoint report arrives, whether the manifest (the commit) is on disk."""

    def __init__(self) -> None:
        self.manifest_existed: dict[int, bool] = {}

    def __call__(self, message: ProgressMessage) -> None:
        if isinstance(message, CheckpointReport):
            self.manifest_existed[message.step] = (Path(message.path) / "manifest.json").is_file()


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def checkpoint_env(directory: Path, every: int, **more: str) -> dict[str, str]:
    return {"TRAINERD_CHECKPOINT_DIR": str(directory), "TRAINERD_CHECKPOINT_EVERY": str(every), **more}


def assert_same_state(first: Path, second: Path) -> None:
    """Two checkpoints hold the same tensors bit for bit (weights, Adam moments, beta powers, step)."""
    a, manifest_a = load_checkpoint(first, 0, 1)
    b, manifest_b = load_checkpoint(second, 0, 1)
    assert manifest_a.meta == manifest_b.meta
    assert sorted(a) == sorted(b) and {"moment1.hidden.weight", "beta1_power", "global_step"} <= set(a)
    for name in a:
        assert np.array_equal(a[name], b[name]), f"{name} differs"


@pytest.fixture(scope="module")
def processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
    procs = Processes(tmp_path_factory.mktemp("mlp_resume"))
    try:
        yield procs
    finally:
        procs.cleanup()


@pytest.fixture(scope="module")
def uninterrupted(processes: Processes, tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, CommitWitness]:
    """The reference: STEPS steps by hand in one go, saving every 10 steps as the launcher asks."""
    root = tmp_path_factory.mktemp("uninterrupted")
    witness = CommitWitness()
    run = run_standalone(processes, root, "reference", ["--steps", str(STEPS), *BY_HAND],
                         env=checkpoint_env(root / "ckpt", 10), on_message=witness)
    assert run.exit_codes() == {"reference": 0}, run.logs
    return run, witness


@pytest.fixture(scope="module")
def two_ranks(processes: Processes, tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, CommitWitness, Path]:
    """20 steps data-parallel on 2 ranks, saving every 10 steps and at step 15, which the agent's control
    file (written before the launch) asks for."""
    root = tmp_path_factory.mktemp("two_ranks")
    control = root / "control.json"
    control.write_text(json.dumps({"schema": 1, "generation": 1, "checkpoint_at_step": 15}))
    envs = cluster_env(root / "progress.sock", free_port(), extra=checkpoint_env(
        root / "ckpt", 10, TRAINERD_CONTROL_FILE=str(control)))
    witness = CommitWitness()
    procs, reports = asyncio.run(run_example(processes, root, envs,
                                             ["--steps", "20", "--seed", str(SEED), "--output", str(root / "out")],
                                             on_message=witness))
    run = Run(procs, reports, root / "out", processes.logs())
    assert run.exit_codes() == {"scheduler": 0, "rank0": 0, "rank1": 0}, run.logs
    return run, witness, root / "ckpt"


def test_each_committed_checkpoint_is_reported_once_after_its_manifest(
    uninterrupted: tuple[Run, CommitWitness],
) -> None:
    run, witness = uninterrupted
    root = run.output.parent / "ckpt"
    assert [(c.step, c.consumed_samples, c.path) for c in run.checkpoints()] == [
        (step, step * GLOBAL_BATCH, str(step_dir(root, step))) for step in (10, 20, 30)
    ]
    assert witness.manifest_existed == {10: True, 20: True, 30: True}
    assert run.reports.index(run.checkpoints()[-1]) < run.reports.index(run.events(0)[-1])
    meta = verify_checkpoint(step_dir(root, 20)).meta
    assert (meta.step, meta.consumed_samples, meta.data_seed, meta.grad_accumulation, meta.skip_ledger) == (
        20, 20 * GLOBAL_BATCH, SEED, 4, ())


def test_a_killed_run_resumed_from_its_checkpoint_ends_bit_identical(
    processes: Processes, uninterrupted: tuple[Run, CommitWitness], tmp_path: Path,
) -> None:
    reference, _ = uninterrupted
    ckpt = tmp_path / "ckpt"
    env = checkpoint_env(ckpt, 10, TRAINERD_CHECKPOINT_KEEP="1000")
    killed = run_standalone(processes, tmp_path, "killed", ["--steps", "1000000", *BY_HAND], env=env,
                            until=lambda reports: any(isinstance(m, CheckpointReport) for m in reports))
    killed.procs["killed"].signal(signal.SIGKILL)
    assert killed.procs["killed"].wait(timeout=10) == -signal.SIGKILL
    first = killed.checkpoints()[0]
    assert first.step == 10

    # As the coordinator relaunches it: the same directory (later steps are saved again over the
    # killed run's), resuming from the checkpoint it reported.
    resumed = run_standalone(processes, tmp_path, "resumed", ["--steps", str(STEPS), *BY_HAND],
                             env=env | {"TRAINERD_RESUME_FROM": first.path})
    assert resumed.exit_codes() == {"resumed": 0}, resumed.logs
    assert [(e.event, e.step) for e in resumed.events(0)] == [(WorkerEvent.STARTED, 10), (WorkerEvent.FINISHED, 30)]
    first_step = resumed.steps(0)[0]  # follows the compilation: the agent's queue is empty, never dropped
    assert (first_step.step, first_step.consumed_samples) == (11, 11 * GLOBAL_BATCH)
    assert [c.step for c in resumed.checkpoints()] == [20, 30]
    weights, expected = resumed.weights(0), reference.weights(0)
    assert sorted(weights) == sorted(expected) == PARAMETERS
    for name in PARAMETERS:
        assert np.array_equal(weights[name], expected[name]), f"{name} differs from the uninterrupted run"
    assert_same_state(step_dir(ckpt, 30), step_dir(reference.output.parent / "ckpt", 30))


def test_two_ranks_save_every_period_and_the_requested_step(two_ranks: tuple[Run, CommitWitness, Path]) -> None:
    run, witness, ckpt = two_ranks
    assert [(c.rank, c.step, c.consumed_samples, c.path) for c in run.checkpoints()] == [
        (0, step, step * GLOBAL_BATCH, str(step_dir(ckpt, step))) for step in (10, 15, 20)
    ]
    assert witness.manifest_existed == {10: True, 15: True, 20: True}
    manifest = verify_checkpoint(step_dir(ckpt, 15))
    assert (manifest.world_size, manifest.generation, manifest.meta.grad_accumulation) == (2, 1, 1)
    assert sorted(p.name for p in step_dir(ckpt, 15).iterdir()) == [
        "manifest.json", "rank_0.safetensors", "rank_1.safetensors"]


def test_a_two_rank_checkpoint_resumes_on_one_rank(
    processes: Processes, two_ranks: tuple[Run, CommitWitness, Path], tmp_path: Path,
) -> None:
    """The same global batch, now split over 4 micro batches of one process: the same sums in another
    order, so the result is close to (not bit-identical with) the two-rank run's."""
    two_rank_run, _, ckpt = two_ranks
    copy = shutil.copytree(step_dir(ckpt, 10), step_dir(tmp_path / "ckpt", 10))  # a resume reads only its own root
    resumed = run_standalone(processes, tmp_path, "resumed", ["--steps", "20", *BY_HAND],
                             env=checkpoint_env(tmp_path / "ckpt", 10, TRAINERD_RESUME_FROM=str(copy)))
    assert resumed.exit_codes() == {"resumed": 0}, resumed.logs
    assert [(e.event, e.step) for e in resumed.events(0)] == [(WorkerEvent.STARTED, 10), (WorkerEvent.FINISHED, 20)]
    first_step = resumed.steps(0)[0]
    assert (first_step.step, first_step.consumed_samples) == (11, 11 * GLOBAL_BATCH)
    manifest = verify_checkpoint(step_dir(tmp_path / "ckpt", 20))
    assert (manifest.world_size, manifest.meta.consumed_samples, manifest.meta.grad_accumulation) == (1, 1280, 4)
    weights, two_rank = resumed.weights(0), two_rank_run.weights(0)
    for name in PARAMETERS:
        assert np.isfinite(weights[name]).all()
        np.testing.assert_allclose(weights[name], two_rank[name], rtol=1e-3, atol=1e-4)


def test_a_one_rank_checkpoint_resumes_on_two_ranks(
    processes: Processes, uninterrupted: tuple[Run, CommitWitness], tmp_path: Path,
) -> None:
    reference, _ = uninterrupted
    copy = shutil.copytree(step_dir(reference.output.parent / "ckpt", 10), step_dir(tmp_path / "ckpt", 10))
    envs = cluster_env(tmp_path / "progress.sock", free_port(), generation=2, extra={
        "TRAINERD_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "TRAINERD_RESUME_FROM": str(copy)})
    procs, reports = asyncio.run(run_example(processes, tmp_path, envs,
                                             ["--steps", "20", "--seed", str(SEED), "--output", str(tmp_path)]))
    run = Run(procs, reports, tmp_path, processes.logs())
    assert run.exit_codes() == {"scheduler": 0, "rank0": 0, "rank1": 0}, run.logs
    for rank in (0, 1):
        assert [(e.event, e.step) for e in run.events(rank)] == [(WorkerEvent.STARTED, 10), (WorkerEvent.FINISHED, 20)]
        assert (run.steps(rank)[0].step, run.steps(rank)[0].consumed_samples) == (11, 11 * GLOBAL_BATCH)
    at_20, _ = load_checkpoint(step_dir(reference.output.parent / "ckpt", 20), 0, 1)
    for name in PARAMETERS:
        assert run.weights(0)[name].tobytes() == run.weights(1)[name].tobytes()
        np.testing.assert_allclose(run.weights(0)[name], at_20[name], rtol=1e-3, atol=1e-4)


def test_the_control_file_asks_for_a_checkpoint_while_training(processes: Processes, tmp_path: Path) -> None:
    """The agent writes the request while the job runs; the worker saves after the requested step, and rank 0
    reports it once the manifest is there."""
    control = tmp_path / "control.json"
    requested: list[int] = []
    witness = CommitWitness()

    def agent(message: ProgressMessage) -> None:
        witness(message)
        if isinstance(message, StepReport) and message.step >= 3 and not requested:
            requested.append(message.step + 1000)  # far enough ahead that the worker has not passed it
            partial = tmp_path / "control.json.tmp"
            partial.write_text(json.dumps({"schema": 1, "generation": 3, "checkpoint_at_step": requested[0]}))
            os.replace(partial, control)

    env = checkpoint_env(tmp_path / "ckpt", 0, TRAINERD_CONTROL_FILE=str(control), TRAINERD_GENERATION="3")
    run = run_standalone(processes, tmp_path, "requested", ["--steps", "1000000", *BY_HAND], env=env,
                         on_message=agent, until=lambda reports: any(isinstance(m, CheckpointReport) for m in reports))
    run.procs["requested"].signal(signal.SIGTERM)
    [report] = run.checkpoints()
    assert (report.generation, report.rank, report.step, report.consumed_samples) == (
        3, 0, requested[0], requested[0] * GLOBAL_BATCH)
    assert report.path == str(step_dir(tmp_path / "ckpt", requested[0]))
    assert witness.manifest_existed == {requested[0]: True}
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        f"step_{requested[0]:08d}", "trainerd-job"]  # nothing periodic
    assert verify_checkpoint(Path(report.path)).generation == 3


def run_by_hand(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(EXAMPLE + argv, env=os.environ | FAST_START_ENV | env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert "Traceback" not in result.stderr, result.stderr
    return [line for line in result.stderr.splitlines() if line.startswith("mlp: ")]


def test_an_unreadable_checkpoint_exits_65_with_one_line(
    uninterrupted: tuple[Run, CommitWitness], tmp_path: Path,
) -> None:
    damaged = tmp_path / "step_00000010"
    shutil.copytree(step_dir(uninterrupted[0].output.parent / "ckpt", 10), damaged)
    data = damaged / "rank_0.safetensors"
    data.chmod(0o600)
    with open(data, "r+b") as f:  # one bit flipped in the last tensor's bytes: the checksum must catch it
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))
    result = run_by_hand(["--steps", str(STEPS), *BY_HAND],
                         {"TRAINERD_CHECKPOINT_DIR": str(tmp_path), "TRAINERD_RESUME_FROM": str(damaged)})
    assert result.returncode == EXIT_CHECKPOINT_UNREADABLE, result.stderr
    [line] = error_lines(result)
    assert line.startswith(f"mlp: cannot resume from checkpoint {damaged}: ") and "checksum" in line, line


def test_a_checkpoint_of_another_seed_exits_2_with_one_line(uninterrupted: tuple[Run, CommitWitness]) -> None:
    checkpoint = step_dir(uninterrupted[0].output.parent / "ckpt", 10)
    argv = ["--steps", str(STEPS), "--seed", str(SEED + 1), "--global-batch", str(GLOBAL_BATCH)]
    result = run_by_hand(argv, {"TRAINERD_CHECKPOINT_DIR": str(checkpoint.parent),
                                "TRAINERD_RESUME_FROM": str(checkpoint)})
    assert result.returncode == EXIT_USAGE, result.stderr
    assert error_lines(result) == [
        f"mlp: checkpoint {checkpoint} was trained with data seed {SEED}, but this run's seed is {SEED + 1}"]


def test_a_checkpoint_outside_the_checkpoint_directory_exits_65_with_one_line(
    uninterrupted: tuple[Run, CommitWitness], tmp_path: Path,
) -> None:
    checkpoint = step_dir(uninterrupted[0].output.parent / "ckpt", 10)
    result = run_by_hand(["--steps", str(STEPS), *BY_HAND],
                         {"TRAINERD_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "TRAINERD_RESUME_FROM": str(checkpoint)})
    assert result.returncode == EXIT_CHECKPOINT_UNREADABLE, result.stderr
    assert error_lines(result) == [f"mlp: cannot resume from checkpoint {checkpoint}: {checkpoint} is not inside the "
                                   f"checkpoint directory {tmp_path / 'ckpt'}"]
