"""A Model.train script with TrainerdCallback, trainerd_dataset and GuardedTrainOneStepCell (callback_job.py), run as
real MindSpore processes on the CPU the way the agent launches them, reporting to a real progress receiver:
progress for every step, checkpoints on the schedule and at the coordinator's request that verify, a bad batch
skipped and reported, a resume in the middle of an epoch that ends bit-identical to the uninterrupted run, a
NaN batch on one of two ranks that both skip, a two-rank checkpoint resumed on one rank with accumulation, a
parameter cut over the ranks by its layout saved and resumed as each rank's own slice (or refused before the
first step when its layout cannot be represented), and nothing at all outside trainerd."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from proto.exit_codes import EXIT_CHECKPOINT_UNREADABLE, EXIT_USAGE
from proto.progress_datagram import BadBatchReport, WarningReport, WorkerEvent
from tests.harness import Processes
from tests.ports import free_port
from tests.trainer.mlp_runs import FAST_START_ENV, Run, cluster_env, run_example
from trainer.checkpoint import load_checkpoint, verify_checkpoint
from trainer.checkpoint.manifest import EpochPosition

pytestmark = pytest.mark.mindspore  # MindSpore processes: left out of `make test-fast`

JOB = [sys.executable, str(Path(__file__).with_name("callback_job.py"))]
EPOCHS, STEPS_PER_EPOCH = 3, 4
STEPS = EPOCHS * STEPS_PER_EPOCH
GLOBAL_BATCH, MICRO_BATCH = 32, 16
NAN_STEP = 3  # reads stream positions 64..95
ARGV = ["--epochs", str(EPOCHS), "--steps-per-epoch", str(STEPS_PER_EPOCH), "--nan-step", str(NAN_STEP)]
WEIGHTS = ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
LOSS_LINE = re.compile(r"^epoch: (\d+) step: (\d+), loss is ", re.MULTILINE)
TABLE = np.arange(48, dtype=np.float32).reshape(8, 6)  # callback_job.py --sharded-table: ranks hold rows of it


def one_rank_env(root: Path, name: str, generation: int = 1, **more: str) -> dict[str, dict[str, str]]:
    """Process `name` launched as trainerd launches a one-rank job (no cluster: no MS_ROLE), the global batch
    of 32 split into 2 micro batches of 16, checkpoints every 5 steps."""
    return {name: FAST_START_ENV | {
        "TRAINERD_JOB": "cb", "TRAINERD_GENERATION": str(generation),
        "TRAINERD_PROGRESS_SOCKET": str(root / "progress.sock"), "TRAINERD_GLOBAL_BATCH": str(GLOBAL_BATCH),
        "TRAINERD_MICRO_BATCH": str(MICRO_BATCH), "TRAINERD_GRAD_ACCUM": "2",
        "TRAINERD_CHECKPOINT_DIR": str(root / "ckpt"), "TRAINERD_CHECKPOINT_EVERY": "5",
        "TRAINERD_CHECKPOINT_KEEP": "100",
    } | more}


def run_job(processes: Processes, root: Path, envs: dict[str, dict[str, str]], *argv: str) -> Run:
    procs, reports = asyncio.run(run_example(processes, root, envs, [*argv, "--output", str(root / "out")],
                                             command=JOB))
    return Run(procs, reports, root / "out", processes.logs())


def step_dir(root: Path, step: int) -> Path:
    return root / "ckpt" / f"step_{step:08d}"


def traced(root: Path, rank: int, step: int) -> dict[str, np.ndarray]:
    with np.load(root / "trace" / f"rank{rank}_step{step}.npz") as saved:
        return {name: saved[name] for name in saved.files}


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return sorted(a) == sorted(b) and all(a[name].tobytes() == b[name].tobytes() for name in a)


def bad_batches(run: Run) -> list[tuple[int, int, int, int]]:
    return [(m.rank, m.step, m.sample_start, m.sample_end) for m in run.reports if isinstance(m, BadBatchReport)]


def two_rank_env(root: Path, **more: str) -> dict[str, dict[str, str]]:
    return cluster_env(root / "progress.sock", free_port(), world_size=2, extra={
        "TRAINERD_GLOBAL_BATCH": str(GLOBAL_BATCH), "TRAINERD_MICRO_BATCH": str(MICRO_BATCH),
        "TRAINERD_GRAD_ACCUM": "1", "TRAINERD_CHECKPOINT_DIR": str(root / "ckpt"), "TRAINERD_CHECKPOINT_EVERY": "4",
        "TRAINERD_CHECKPOINT_KEEP": "100"} | more)


@pytest.fixture(scope="module")
def processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
    procs = Processes(tmp_path_factory.mktemp("callback"))
    try:
        yield procs
    finally:
        procs.cleanup()


@pytest.fixture(scope="module")
def reference(processes: Processes, tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path]:
    """12 steps in 3 epochs on one rank; the samples of step 3 are NaN; the control file (written before the
    launch, as the agent would) asks for a checkpoint at step 7."""
    root = tmp_path_factory.mktemp("reference")
    control = root / "control.json"
    control.write_text(json.dumps({"schema": 1, "generation": 1, "checkpoint_at_step": 7}))
    run = run_job(processes, root, one_rank_env(root, "reference", TRAINERD_CONTROL_FILE=str(control)), *ARGV,
                  "--trace", str(root / "trace"))
    assert run.exit_codes() == {"reference": 0}, run.logs
    return run, root


@pytest.fixture(scope="module")
def two_ranks(processes: Processes, tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path]:
    """The same job on two ranks (16 samples each per step, no accumulation); only rank 1's samples of step 3
    are NaN; checkpoints every 4 steps; each rank holds 4 rows of the 8-row parameter 'table'."""
    root = tmp_path_factory.mktemp("two_ranks")
    run = run_job(processes, root, two_rank_env(root), *ARGV, "--nan-rank", "1", "--trace", str(root / "trace"),
                  "--sharded-table", "arange")
    assert run.exit_codes() == {"scheduler": 0, "rank0": 0, "rank1": 0}, run.logs
    return run, root


def test_every_step_is_reported_to_the_agent_socket(reference: tuple[Run, Path]) -> None:
    run, _ = reference
    assert [(e.event, e.step) for e in run.events(0)] == [(WorkerEvent.STARTED, 0), (WorkerEvent.FINISHED, STEPS)]
    steps = run.steps(0)
    assert [(s.step, s.consumed_samples) for s in steps] == [(n, n * GLOBAL_BATCH) for n in range(1, STEPS + 1)]
    assert [s.epoch for s in steps] == [(n - 1) // STEPS_PER_EPOCH + 1 for n in range(1, STEPS + 1)]  # Model.train's
    assert all(s.samples_per_s > 0 for s in steps)
    good = [n != NAN_STEP for n in range(1, STEPS + 1)]
    assert [np.isfinite(s.loss) and np.isfinite(s.grad_norm) and s.grad_norm > 0 for s in steps] == good


def test_checkpoints_follow_the_schedule_and_the_request_and_verify(reference: tuple[Run, Path]) -> None:
    run, root = reference
    assert [(c.rank, c.step, c.consumed_samples, c.path) for c in run.checkpoints()] == [
        (0, step, step * GLOBAL_BATCH, str(step_dir(root, step))) for step in (5, 7, 10)]
    for step in (5, 7, 10):
        manifest = verify_checkpoint(step_dir(root, step))
        meta = manifest.meta
        assert (manifest.world_size, meta.step, meta.consumed_samples, meta.data_seed, meta.grad_accumulation,
                meta.skip_ledger) == (1, step, step * GLOBAL_BATCH, 0, 2, ((64, 96),))
        assert meta.epoch_position == EpochPosition(*divmod(step, STEPS_PER_EPOCH), STEPS_PER_EPOCH)
    tensors, _ = load_checkpoint(step_dir(root, 10), 0, 1)
    assert set(WEIGHTS) | {"moments.fc1.weight", "global_step", "guard.log_norm_mean", "guard.log_norm_var",
                           "guard.accepted_steps"} <= set(tensors)
    assert int(tensors["guard.accepted_steps"]) == 9  # ten steps, one skipped
    assert same({name: tensors[name] for name in WEIGHTS}, traced(root, 0, 10))


def test_model_fit_evaluating_every_epoch_saves_and_trains_as_model_train_does(
        processes: Processes, reference: tuple[Run, Path], tmp_path: Path) -> None:
    # Model.fit enters and leaves the callbacks' contexts again for each evaluation, inside the training's:
    # the first evaluation (after step 4) closed the checkpoint writer, and the save of step 5 failed.
    control = tmp_path / "control.json"
    control.write_text(json.dumps({"schema": 1, "generation": 1, "checkpoint_at_step": 7}))
    run = run_job(processes, tmp_path, one_rank_env(tmp_path, "fit", TRAINERD_CONTROL_FILE=str(control)), *ARGV,
                  "--fit-valid")
    assert run.exit_codes() == {"fit": 0}, run.logs
    assert [(c.step, c.path) for c in run.checkpoints()] == [(step, str(step_dir(tmp_path, step))) for step in (5, 7, 10)]
    for step in (5, 7, 10):
        assert verify_checkpoint(step_dir(tmp_path, step)).meta.step == step
    assert [s.step for s in run.steps(0)] == list(range(1, STEPS + 1))
    assert same(run.weights(0), reference[0].weights(0))  # evaluating changes no weight
    # Each evaluation tells the agent it goes on (no step for that long is no hang), at the step it follows.
    evaluating = {e.step for e in run.events(0) if e.event is WorkerEvent.EVALUATING}
    assert evaluating == {STEPS_PER_EPOCH * epoch for epoch in range(1, EPOCHS + 1)}, run.events(0)


def test_a_model_eval_that_the_scripts_own_callback_runs_is_reported_while_training_runs(
        processes: Processes, reference: tuple[Run, Path], tmp_path: Path) -> None:
    # ModelZoo's EvalCallBack calls model.eval(dataset) in epoch_end, with no callbacks: TrainerdCallback hears
    # of it only through the Model.eval it watches while the training runs.
    run = run_job(processes, tmp_path, one_rank_env(tmp_path, "eval"), *ARGV, "--eval-callback")
    assert run.exit_codes() == {"eval": 0}, run.logs
    assert run.logs.count("eval {'accuracy'") == EPOCHS + 1, run.logs  # each epoch's, and one after
    assert same(run.weights(0), reference[0].weights(0))
    events = [(e.event, e.step) for e in run.events(0)]
    evaluating = [step for event, step in events if event is WorkerEvent.EVALUATING]
    assert evaluating == [STEPS_PER_EPOCH * epoch for epoch in range(1, EPOCHS + 1)], events
    # The evaluation after training is not reported: the agent has heard FINISHED, after which no step is awaited.
    assert events[-1] == (WorkerEvent.FINISHED, STEPS), events


def test_a_nan_batch_is_reported_and_leaves_the_weights_unchanged(reference: tuple[Run, Path]) -> None:
    run, root = reference
    [report] = [m for m in run.reports if isinstance(m, BadBatchReport)]
    assert (report.rank, report.step, report.sample_start, report.sample_end) == (0, NAN_STEP, 64, 96)
    assert report.reason in ("nonfinite_loss", "nonfinite_grad_norm")
    assert same(traced(root, 0, NAN_STEP), traced(root, 0, NAN_STEP - 1))
    assert not same(traced(root, 0, NAN_STEP + 1), traced(root, 0, NAN_STEP))


def test_a_run_resumed_in_the_middle_of_an_epoch_ends_bit_identical(
    processes: Processes, reference: tuple[Run, Path], tmp_path: Path,
) -> None:
    """Step 5 is the first of epoch 2: Model.train restarts in epoch 2 and the dataset skips its first step."""
    reference_run, reference_root = reference
    copy = shutil.copytree(step_dir(reference_root, 5), step_dir(tmp_path, 5))  # a resume reads only its own root
    env = one_rank_env(tmp_path, "resumed_mid_epoch", generation=2, TRAINERD_RESUME_FROM=str(copy))
    resumed = run_job(processes, tmp_path, env, *ARGV)
    assert resumed.exit_codes() == {"resumed_mid_epoch": 0}, resumed.logs
    assert [(e.event, e.step) for e in resumed.events(0)] == [(WorkerEvent.STARTED, 5), (WorkerEvent.FINISHED, STEPS)]
    assert [(s.step, s.consumed_samples) for s in resumed.steps(0)] == [
        (n, n * GLOBAL_BATCH) for n in range(6, STEPS + 1)]
    assert [c.step for c in resumed.checkpoints()] == [10]
    printed = LOSS_LINE.findall(resumed.procs["resumed_mid_epoch"].log())
    assert printed[0] == ("2", "2") and printed[-1] == (str(EPOCHS), str(STEPS_PER_EPOCH)), printed
    assert same(resumed.weights(0), reference_run.weights(0))
    ours, _ = load_checkpoint(step_dir(tmp_path, 10), 0, 1)
    theirs, _ = load_checkpoint(step_dir(reference_root, 10), 0, 1)
    assert same(ours, theirs)  # weights, momenta, the optimizer's step and the guard's state


def test_a_resume_with_fewer_steps_per_epoch_continues_the_same_epoch_and_ends_with_the_epochs_asked(
    processes: Processes, reference: tuple[Run, Path], tmp_path: Path,
) -> None:
    """A world size without a fixed global batch changes a script's steps per epoch. Step 10 of the 4-step epochs
    is halfway through epoch 3; with 2-step epochs the resume goes on in epoch 3 from its halfway point, one step
    to the end, not to epoch 6 (step 10 // 2 + 1), past `--epochs 3`, where Model.train refuses to start."""
    _, reference_root = reference
    copy = shutil.copytree(step_dir(reference_root, 10), step_dir(tmp_path, 10))
    env = one_rank_env(tmp_path, "shorter_epochs", generation=2, TRAINERD_RESUME_FROM=str(copy))
    resumed = run_job(processes, tmp_path, env, "--epochs", str(EPOCHS), "--steps-per-epoch", "2")
    assert resumed.exit_codes() == {"shorter_epochs": 0}, resumed.logs
    assert [(e.event, e.step) for e in resumed.events(0)] == [(WorkerEvent.STARTED, 10), (WorkerEvent.FINISHED, 11)]
    assert [(s.step, s.consumed_samples, s.epoch) for s in resumed.steps(0)] == [(11, 11 * GLOBAL_BATCH, 3)]


def own_dataset_env(root: Path, name: str, **more: str) -> dict[str, dict[str, str]]:
    """As one_rank_env, for a script that batches its own dataset: no batch split (the job sets none)."""
    env = one_rank_env(root, name, **more)
    return {name: {key: value for key, value in env[name].items()
                   if key not in ("TRAINERD_GLOBAL_BATCH", "TRAINERD_MICRO_BATCH", "TRAINERD_GRAD_ACCUM")}}


def test_a_dataset_of_the_scripts_own_resumes_inside_its_epoch_to_the_same_weights(
        processes: Processes, tmp_path_factory: pytest.TempPathFactory) -> None:
    """No trainerd_dataset: the script batches its samples itself, in order (as a MindDataset pipeline does).
    resume_epoch reads the checkpoint's place in the epochs and positions the dataset inside the epoch, so the
    resumed run trains steps 6 to 12, not the epochs done again, and reads what the uninterrupted run read."""
    argv = ["--epochs", str(EPOCHS), "--steps-per-epoch", str(STEPS_PER_EPOCH), "--own-dataset"]
    root = tmp_path_factory.mktemp("own_dataset")
    whole = run_job(processes, root, own_dataset_env(root, "whole"), *argv)
    assert whole.exit_codes() == {"whole": 0}, whole.logs
    assert [(s.step, s.epoch) for s in whole.steps(0)] == [
        (n, (n - 1) // STEPS_PER_EPOCH + 1) for n in range(1, STEPS + 1)]
    manifest = verify_checkpoint(step_dir(root, 5))
    assert manifest.meta.epoch_position == EpochPosition(1, 1, STEPS_PER_EPOCH)

    resumed_root = tmp_path_factory.mktemp("own_dataset_resumed")
    copy = shutil.copytree(step_dir(root, 5), step_dir(resumed_root, 5))
    resumed = run_job(processes, resumed_root, own_dataset_env(resumed_root, "resumed", TRAINERD_GENERATION="2",
                                                               TRAINERD_RESUME_FROM=str(copy)), *argv)
    assert resumed.exit_codes() == {"resumed": 0}, resumed.logs
    assert [(s.step, s.epoch) for s in resumed.steps(0)] == [
        (n, (n - 1) // STEPS_PER_EPOCH + 1) for n in range(6, STEPS + 1)]
    printed = LOSS_LINE.findall(resumed.procs["resumed"].log())
    assert printed[0] == ("2", "2") and printed[-1] == (str(EPOCHS), str(STEPS_PER_EPOCH)), printed
    assert same(resumed.weights(0), whole.weights(0))



def test_several_epochs_of_a_dataset_no_resume_could_position_are_refused_at_the_first_start(
        processes: Processes, tmp_path: Path) -> None:
    """The script's own dataset, never given to resume_epoch: its first resume after epoch 1 would read the
    epoch from its start at the wrong epoch. Told at the job's first start, before its first step."""
    argv = ["--epochs", str(EPOCHS), "--steps-per-epoch", str(STEPS_PER_EPOCH), "--own-dataset", "--from-epoch-0"]
    forgot = run_job(processes, tmp_path, own_dataset_env(tmp_path, "forgot"), *argv)
    assert forgot.exit_codes() == {"forgot": EXIT_USAGE}, forgot.logs
    assert error_lines(forgot, "forgot") == [
        f"TrainerdCallback: Model.train runs {EPOCHS} epochs of a dataset resume_epoch did not position, so a resume "
        "after its first epoch could not go on where it stopped: pass initial_epoch=resume_epoch(dataset) to "
        "Model.train"]
    assert forgot.steps(0) == [] and forgot.events(0) == []


def test_a_nan_batch_on_one_rank_makes_both_ranks_skip(two_ranks: tuple[Run, Path]) -> None:
    run, root = two_ranks
    assert bad_batches(run) == [(0, NAN_STEP, 64, 96)]
    for rank in (0, 1):
        [at_nan] = [s for s in run.steps(rank) if s.step == NAN_STEP]
        assert not np.isfinite(at_nan.grad_norm)
        assert same(traced(root, rank, NAN_STEP), traced(root, rank, NAN_STEP - 1))
        assert not same(traced(root, rank, NAN_STEP + 1), traced(root, rank, NAN_STEP))
    assert same(run.weights(0), run.weights(1))
    manifest = verify_checkpoint(step_dir(root, 8))
    assert (manifest.world_size, manifest.meta.grad_accumulation, manifest.meta.skip_ledger) == (2, 1, ((64, 96),))


def test_a_two_rank_checkpoint_resumes_on_one_rank_with_accumulation(
    processes: Processes, two_ranks: tuple[Run, Path], tmp_path: Path,
) -> None:
    """Rank r's 16 samples become micro batch r of the single rank: the same global batch, so the run ends
    where the two-rank run did (up to the order of the sums)."""
    two_rank_run, two_rank_root = two_ranks
    copy = shutil.copytree(step_dir(two_rank_root, 4), step_dir(tmp_path, 4))
    env = one_rank_env(tmp_path, "resumed_on_one_rank", generation=2, TRAINERD_RESUME_FROM=str(copy))
    resumed = run_job(processes, tmp_path, env, *ARGV)  # step 3, NaN on rank 1 before, is not read again
    assert resumed.exit_codes() == {"resumed_on_one_rank": 0}, resumed.logs
    assert [(e.event, e.step) for e in resumed.events(0)] == [(WorkerEvent.STARTED, 4), (WorkerEvent.FINISHED, STEPS)]
    assert resumed.steps(0)[0].consumed_samples == 5 * GLOBAL_BATCH
    manifest = verify_checkpoint(step_dir(tmp_path, 10))
    assert (manifest.world_size, manifest.meta.grad_accumulation) == (1, 2)
    weights, expected = resumed.weights(0), two_rank_run.weights(0)
    for name in WEIGHTS:
        np.testing.assert_allclose(weights[name], expected[name], rtol=1e-5, atol=1e-6)


def test_each_rank_saves_its_own_rows_of_a_parameter_its_layout_cuts(two_ranks: tuple[Run, Path]) -> None:
    _, root = two_ranks
    table = verify_checkpoint(step_dir(root, 8)).tensors["table"]
    assert table.shape == (8, 6)
    assert sorted((c.file, c.region.offsets, c.region.sizes) for c in table.chunks) == [
        ("rank_0.safetensors", (0, 0), (4, 6)), ("rank_1.safetensors", (4, 0), (4, 6))]
    for world_size in (1, 3):
        assert load_checkpoint(step_dir(root, 8), 0, world_size)[0]["table"].tobytes() == TABLE.tobytes()


def test_a_two_rank_resume_loads_each_rank_its_own_rows_of_the_cut_parameter(
    processes: Processes, two_ranks: tuple[Run, Path], tmp_path: Path,
) -> None:
    copy = shutil.copytree(step_dir(two_ranks[1], 4), step_dir(tmp_path, 4))
    env = two_rank_env(tmp_path, TRAINERD_GENERATION="2", TRAINERD_RESUME_FROM=str(copy))
    resumed = run_job(processes, tmp_path, env, *ARGV, "--sharded-table", "zeros")  # starts from zeros
    assert resumed.exit_codes() == {"scheduler": 0, "rank0": 0, "rank1": 0}, resumed.logs
    assert [(e.event, e.step) for e in resumed.events(1)] == [(WorkerEvent.STARTED, 4), (WorkerEvent.FINISHED, STEPS)]
    for rank in (0, 1):
        assert np.load(resumed.output / f"table_rank{rank}.npy").tobytes() == TABLE[4 * rank:4 * rank + 4].tobytes()
    assert same(resumed.weights(0), two_ranks[0].weights(0))


def test_a_layout_that_cannot_be_saved_exactly_is_refused_before_the_first_step(
    processes: Processes, tmp_path: Path,
) -> None:
    run = run_job(processes, tmp_path, one_rank_env(tmp_path, "embedding_field"), *ARGV,
                  "--sharded-table", "arange", "--table-field-size", "2")
    assert run.exit_codes() == {"embedding_field": EXIT_USAGE}, run.logs
    assert error_lines(run, "embedding_field") == [
        "TrainerdCallback: cannot checkpoint this parallel layout: parameter 'table': embedding fields "
        "(field_size 2) cannot be represented"]
    assert run.steps(0) == []


def test_outside_trainerd_the_callback_only_says_so(processes: Processes, tmp_path: Path) -> None:
    run = run_job(processes, tmp_path, {"by_hand": dict(FAST_START_ENV)}, *ARGV)
    assert run.exit_codes() == {"by_hand": 0}, run.logs
    assert run.reports == []
    log = run.procs["by_hand"].log()
    assert log.count("TrainerdCallback") == 1 and "not launched by trainerd" in log, log
    assert len(LOSS_LINE.findall(log)) == STEPS
    assert all(np.isfinite(array).all() for array in run.weights(0).values())


def error_lines(run: Run, name: str) -> list[str]:
    log = run.procs[name].log()
    assert "Traceback" not in log, log
    return [line for line in log.splitlines() if line.startswith(("TrainerdCallback: ", "trainerd_dataset: "))]


def test_a_resume_whose_model_train_began_behind_the_dataset_counts_the_datasets_epochs_to_the_same_weights(
    processes: Processes, reference: tuple[Run, Path], tmp_path: Path,
) -> None:
    """Model.train always starts at epoch 1 (the issue's script took its epoch from a checkpoint of its own,
    older than trainerd's): the resume inside epoch 2 is renumbered as the dataset's epochs, stops after epoch 3
    rather than run a fourth, warns, and ends bit-identical to the run without the fault."""
    reference_run, reference_root = reference
    copy = shutil.copytree(step_dir(reference_root, 5), step_dir(tmp_path, 5))
    env = one_rank_env(tmp_path, "behind", generation=2, TRAINERD_RESUME_FROM=str(copy))
    behind = run_job(processes, tmp_path, env, *ARGV, "--from-epoch-0")
    assert behind.exit_codes() == {"behind": 0}, behind.logs
    assert [(s.step, s.epoch) for s in behind.steps(0)] == [
        (n, (n - 1) // STEPS_PER_EPOCH + 1) for n in range(6, STEPS + 1)]
    printed = LOSS_LINE.findall(behind.procs["behind"].log())
    assert printed[0] == ("2", "2") and printed[-1] == (str(EPOCHS), str(STEPS_PER_EPOCH)), printed
    [warning] = [m for m in behind.reports if isinstance(m, WarningReport)]
    assert warning.text == ("Model.train began epoch 1, but trainerd's checkpoint is in epoch 2 (after step 5): its "
                            f"epochs are counted as the dataset's, and it stops after epoch {EPOCHS}; pass "
                            "initial_epoch=resume_epoch(dataset) to Model.train to avoid this")
    assert same(behind.weights(0), reference_run.weights(0))


def test_a_resume_from_an_unreadable_checkpoint_exits_with_one_line(
    processes: Processes, tmp_path: Path,
) -> None:
    missing = step_dir(tmp_path, 6)
    unreadable = run_job(processes, tmp_path, one_rank_env(tmp_path, "unreadable", TRAINERD_RESUME_FROM=str(missing)),
                         *ARGV)
    assert unreadable.exit_codes() == {"unreadable": EXIT_CHECKPOINT_UNREADABLE}, unreadable.logs
    assert error_lines(unreadable, "unreadable") == [
        f"trainerd_dataset: cannot resume from checkpoint {missing}: step_00000006/manifest.json is missing"]
