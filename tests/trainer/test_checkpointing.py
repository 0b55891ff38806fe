"""TrainingCheckpoints in one process with real MindSpore cells (no training, no cluster): what is saved
and reported when, what a resume restores, and how each way a resume can fail is told apart."""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import replace
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from agent.snapshots.checkpoint_persister import CheckpointPersister, Outbox, PersistedSave
from common.clock import FakeClock
from proto.exit_codes import EXIT_CHECKPOINT_UNREADABLE, EXIT_USAGE
from tests.waiting import wait_until
from trainer.checkpoint import verify_checkpoint
from trainer.checkpoint.mindspore_io import parameters_to_numpy
from trainer.examples.mlp import checkpoint_settings
from trainer.runtime.checkpointing import CheckpointUnreadable, ResumePosition, SeedMismatch, TrainingCheckpoints
from trainer.runtime.memory_snapshots import PLAN_NAME
from trainer.runtime.rank_context import RankCheckpointSettings, RankContext
from trainer.runtime.snapshot_interval import FIRST_SNAPSHOT_AFTER

SEED = 7


class Reporter:
    """Stands in for the ProgressReporter: records each checkpoint report and whether its manifest existed."""

    def __init__(self) -> None:
        self.reports: list[tuple[int, int, str, bool]] = []
        self.failures: list[tuple[int, str]] = []
        self.stalls: list[float] = []

    def add_checkpoint_stall(self, seconds: float) -> None:
        self.stalls.append(seconds)

    def checkpoint(self, step: int, consumed_samples: int, path: str) -> None:
        self.reports.append((step, consumed_samples, path, (Path(path) / "manifest.json").is_file()))

    def checkpoint_failed(self, step: int, reason: str) -> None:
        self.failures.append((step, reason))


def cells(out: int = 3) -> tuple[nn.Cell, nn.Optimizer]:
    network = nn.Dense(4, out)
    return network, nn.Adam(network.trainable_params(), learning_rate=0.1)


def perturb(network: nn.Cell, value: float) -> None:
    """Stands in for a training step: every weight changes."""
    for param in network.trainable_params():
        param.set_data(ms.Tensor(np.full(param.shape, value, np.float32)))


def checkpoints(settings: RankCheckpointSettings, cell_pair: tuple[nn.Cell, nn.Optimizer],
                reporter: Reporter, seed: int = SEED) -> TrainingCheckpoints:
    ctx = RankContext.from_environ({"TRAINERD_JOB": "unit"})
    return TrainingCheckpoints(ctx, settings, reporter, cell_pair, data_seed=seed,  # type: ignore[arg-type]
                               grad_accumulation=2)


def train(tmp_path: Path, every: int, steps: int) -> tuple[Reporter, tuple[nn.Cell, nn.Optimizer]]:
    reporter, pair = Reporter(), cells()
    with checkpoints(RankCheckpointSettings(directory=tmp_path / "ckpt", every=every), pair, reporter) as ckpt:
        assert ckpt.resume() == ResumePosition(0, 0)
        for step in range(1, steps + 1):
            perturb(pair[0], float(step))
            ckpt.after_step(step, step * 16)
    return reporter, pair


def test_each_save_is_reported_after_its_commit_and_the_last_one_on_close(tmp_path: Path) -> None:
    reporter, _ = train(tmp_path, every=2, steps=7)
    ckpt = tmp_path / "ckpt"
    assert reporter.reports == [(step, step * 16, str(ckpt / f"step_{step:08d}"), True) for step in (2, 4, 6)]
    meta = verify_checkpoint(ckpt / "step_00000006").meta
    assert (meta.step, meta.consumed_samples, meta.data_seed, meta.grad_accumulation, meta.skip_ledger) == (
        6, 96, SEED, 2, ())
    # Each save blocked the step loop for its copy to host memory: the goodput's checkpoint stall.
    assert len(reporter.stalls) == 3 and all(seconds > 0 for seconds in reporter.stalls)


def test_a_resume_restores_every_parameter_bit_for_bit(tmp_path: Path) -> None:
    _, trained = train(tmp_path, every=4, steps=4)
    saved = {name: array.copy() for name, array in parameters_to_numpy(*trained).items()}
    assert {"weight", "moment1.weight", "beta1_power", "global_step"} <= set(saved)
    fresh = cells()
    settings = RankCheckpointSettings(directory=tmp_path / "ckpt", resume_from=tmp_path / "ckpt" / "step_00000004")
    with checkpoints(settings, fresh, Reporter()) as ckpt:
        assert ckpt.resume() == ResumePosition(4, 64)
    restored = parameters_to_numpy(*fresh)
    assert sorted(restored) == sorted(saved)
    for name, array in saved.items():
        assert np.array_equal(restored[name], array), name


def test_in_memory_snapshots_are_checkpoints_in_the_agents_memory_and_resume_bit_for_bit(tmp_path: Path) -> None:
    """Every memory_every steps beside the disk saves, not reported (the agent sees the manifest), at most one
    complete one kept; a resume from the one the agent names restores every parameter."""
    memory, reporter, pair = tmp_path / "shm" / "job", Reporter(), cells()
    settings = RankCheckpointSettings(directory=tmp_path / "ckpt", every=4, memory_directory=memory, memory_every=3)
    with checkpoints(settings, pair, reporter) as ckpt:
        for step in range(1, 8):
            perturb(pair[0], float(step))
            ckpt.after_step(step, step * 16)
            if step == 6:
                saved = {name: array.copy() for name, array in parameters_to_numpy(*pair).items()}
    assert [r[0] for r in reporter.reports] == [4] and len(reporter.stalls) == 3  # 3, 4 (disk) and 6
    assert sorted(p.name for p in memory.iterdir()) == ["step_00000006"]  # retention removed step 3
    meta = verify_checkpoint(memory / "step_00000006").meta
    assert (meta.step, meta.consumed_samples, meta.data_seed, meta.grad_accumulation) == (6, 96, SEED, 2)

    fresh = cells()
    settings = RankCheckpointSettings(directory=tmp_path / "ckpt", memory_directory=memory, memory_every=3,
                                  resume_from=memory / "step_00000006", memory_step=6)
    with checkpoints(settings, fresh, Reporter()) as ckpt:
        assert ckpt.resume() == ResumePosition(6, 96)
    restored = parameters_to_numpy(*fresh)
    for name, array in saved.items():
        assert np.array_equal(restored[name], array), name
    # The coordinator chose a snapshot the agent did not name (it has none on this host): never start fresh.
    with pytest.raises(CheckpointUnreadable, match="in-memory snapshot of step 6: the agent named none") as none:
        checkpoints(replace(settings, resume_from=None), cells(), Reporter()).resume()
    assert none.value.exit_code == EXIT_CHECKPOINT_UNREADABLE


def test_with_the_agent_saving_each_share_goes_through_the_outbox_into_the_same_checkpoint(tmp_path: Path) -> None:
    """`checkpoint.saved_by: agent`: the rank hands each share to a real agent persister and reports no
    commit itself (the agent does); the checkpoints are byte for byte those the rank would have written;
    closing waits until the last one is on disk."""
    outbox = tmp_path / "shm" / "job" / ".outbox"
    outbox.mkdir(parents=True)
    saved: list[PersistedSave] = []
    persister = CheckpointPersister(Outbox(outbox, tmp_path / "by-agent", (0,), 1, 0, 3), saved.append,
                                    lambda failed: pytest.fail(failed.reason))
    persister.start()
    reporter, pair = Reporter(), cells()
    settings = RankCheckpointSettings(directory=tmp_path / "by-agent", every=2, outbox=outbox)
    try:
        with checkpoints(settings, pair, reporter) as ckpt:
            for step in range(1, 8):
                perturb(pair[0], float(step))
                ckpt.after_step(step, step * 16)
        assert [s.step for s in saved] == [2, 4, 6]  # step 6 before close() returned
    finally:
        persister.stop()
    assert reporter.reports == reporter.failures == [] and len(reporter.stalls) == 3
    assert list(outbox.iterdir()) == []
    train(tmp_path / "by-worker", every=2, steps=7)
    for step in (2, 4, 6):
        by_agent = tmp_path / "by-agent" / f"step_{step:08d}"
        by_worker = tmp_path / "by-worker" / "ckpt" / f"step_{step:08d}"
        assert sorted(p.name for p in by_agent.iterdir()) == sorted(p.name for p in by_worker.iterdir())
        for file in by_worker.iterdir():
            assert (by_agent / file.name).read_bytes() == file.read_bytes(), (step, file.name)


def test_with_snapshots_on_the_agent_saves_from_the_snapshot_and_the_step_pays_one_copy(tmp_path: Path) -> None:
    """`saved_by: agent` with in-memory snapshots: every disk save step is a snapshot step as well, and the
    rank's share is the snapshot's own file, linked into the outbox: one stall per such step, not two. The
    agent's checkpoints are still byte for byte the workers'."""
    memory = tmp_path / "shm" / "job"
    outbox = memory / ".outbox"
    outbox.mkdir(parents=True)
    saved: list[PersistedSave] = []
    persister = CheckpointPersister(Outbox(outbox, tmp_path / "by-agent", (0,), 1, 0, 3), saved.append,
                                    lambda failed: pytest.fail(failed.reason))
    reporter, pair = Reporter(), cells()
    settings = RankCheckpointSettings(directory=tmp_path / "by-agent", every=2, outbox=outbox,
                                  memory_directory=memory, memory_every=3)
    with checkpoints(settings, pair, reporter) as ckpt:
        for step in range(1, 8):
            perturb(pair[0], float(step))
            ckpt.after_step(step, step * 16)
            if step % 2 == 0:  # the agent's turn, in this thread: take the share as it finds it
                share = outbox / f"step_{step:08d}"
                wait_until(lambda share=share: (share / "rank_0.done.json").exists(), 30, f"step {step}'s share")
                snapshot = memory / f"step_{step:08d}" / "rank_0.safetensors"
                assert os.stat(share / "rank_0.safetensors").st_ino == os.stat(snapshot).st_ino  # one file
                assert persister.persist_ready() == 1
    assert [s.step for s in saved] == [2, 4, 6]
    # Saves at 2, 4 and 6 (6 also the snapshot step it would have been), a snapshot alone at 3: four stalls.
    assert reporter.failures == [] and len(reporter.stalls) == 4
    assert sorted(p.name for p in memory.iterdir()) == [".outbox", "step_00000006"]
    assert list(outbox.iterdir()) == []
    train(tmp_path / "by-worker", every=2, steps=7)
    for step in (2, 4, 6):
        by_agent = tmp_path / "by-agent" / f"step_{step:08d}"
        by_worker = tmp_path / "by-worker" / "ckpt" / f"step_{step:08d}"
        assert sorted(p.name for p in by_agent.iterdir()) == sorted(p.name for p in by_worker.iterdir())
        for file in by_worker.iterdir():
            assert (by_agent / file.name).read_bytes() == file.read_bytes(), (step, file.name)


def test_a_share_the_agent_never_takes_is_removed_and_reported_and_training_goes_on(tmp_path: Path) -> None:
    outbox = tmp_path / "shm" / "job" / ".outbox"
    outbox.mkdir(parents=True)
    reporter, pair, clock = Reporter(), cells(), FakeClock()
    settings = RankCheckpointSettings(directory=tmp_path / "ckpt", every=2, outbox=outbox)
    ctx = RankContext.from_environ({"TRAINERD_JOB": "unit"})
    with TrainingCheckpoints(ctx, settings, reporter, pair, data_seed=SEED,  # type: ignore[arg-type]
                             grad_accumulation=2, clock=clock) as ckpt:
        for step in range(1, 5):
            perturb(pair[0], float(step))
            ckpt.after_step(step, step * 16)
    assert [step for step, _ in reporter.failures] == [2, 4]
    assert all("the agent did not take this rank's share within 600 s" in r for _, r in reporter.failures)
    assert [sorted(os.listdir(d)) for d in sorted(outbox.iterdir())] == [[], []]  # no memory kept


def test_auto_snapshots_start_a_few_steps_in_and_plan_the_next_within_the_disk_interval(tmp_path: Path) -> None:
    """With "auto" a real snapshot is taken FIRST_SNAPSHOT_AFTER steps in, and rank 0 plans the next one from
    what it measured, no later than the disk interval allows."""
    memory, pair = tmp_path / "shm" / "job", cells()
    settings = RankCheckpointSettings(directory=tmp_path / "ckpt", every=8, memory_directory=memory, memory_every="auto")
    with checkpoints(settings, pair, Reporter()) as ckpt:
        for step in range(1, FIRST_SNAPSHOT_AFTER + 1):
            perturb(pair[0], float(step))
            ckpt.after_step(step, step * 16)
    assert verify_checkpoint(memory / f"step_{FIRST_SNAPSHOT_AFTER:08d}").meta.step == FIRST_SNAPSHOT_AFTER
    plan = json.loads((memory / PLAN_NAME).read_text())
    assert plan["after"] == FIRST_SNAPSHOT_AFTER and FIRST_SNAPSHOT_AFTER < plan["next"] <= FIRST_SNAPSHOT_AFTER + 8


def test_resume_failures_carry_their_exit_status(tmp_path: Path) -> None:
    train(tmp_path, every=4, steps=4)
    step_4 = tmp_path / "ckpt" / "step_00000004"

    def resume(path: Path, pair: tuple[nn.Cell, nn.Optimizer] | None = None, seed: int = SEED) -> None:
        settings = RankCheckpointSettings(directory=tmp_path / "ckpt", resume_from=path)
        with checkpoints(settings, pair or cells(), Reporter(), seed) as ckpt:
            ckpt.resume()

    with pytest.raises(CheckpointUnreadable, match=f"^cannot resume from checkpoint {tmp_path}/ckpt/nowhere: "
                                                   "nowhere/manifest.json is missing$") as missing:
        resume(tmp_path / "ckpt" / "nowhere")
    assert missing.value.exit_code == EXIT_CHECKPOINT_UNREADABLE
    with pytest.raises(CheckpointUnreadable, match="parameter 'weight' is float32 \\[5, 4\\], the checkpoint "
                                                   "holds float32 \\[3, 4\\]"):
        resume(step_4, cells(out=5))
    with pytest.raises(SeedMismatch, match="was trained with data seed 7, but this run's seed is 8") as other_seed:
        resume(step_4, seed=8)
    assert other_seed.value.exit_code == EXIT_USAGE


def test_a_failed_save_is_logged_and_training_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "ckpt").write_text("a file where the checkpoint directory should be")
    with caplog.at_level(logging.ERROR):
        reporter, _ = train(tmp_path, every=1, steps=3)
    assert reporter.reports == []
    assert caplog.text.count("could not start the checkpoint of step") == 3
    assert [step for step, _ in reporter.failures] == [1, 2, 3]
    assert all("Not a directory" in reason or "File exists" in reason for _, reason in reporter.failures)


def test_a_save_that_runs_out_of_space_is_reported_and_the_next_one_commits(tmp_path: Path) -> None:
    """The disk fills while step 2's file is written (its temporary file is /dev/full, where every write
    fails with ENOSPC): the step loop goes on, the failure is reported with its reason, step 2 is never
    reported as committed nor left with a manifest, and step 4 commits (retention then removes step 2's
    leftovers)."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "step_00000002").mkdir(parents=True)
    (ckpt / "step_00000002" / ".rank_0.safetensors.tmp").symlink_to("/dev/full")
    reporter, _ = train(tmp_path, every=2, steps=4)
    assert reporter.failures == [(2, reporter.failures[0][1])]
    assert "No space left on device" in reporter.failures[0][1], reporter.failures
    assert [(step, committed) for step, _, _, committed in reporter.reports] == [(4, True)]
    assert verify_checkpoint(ckpt / "step_00000004").meta.step == 4
    assert not (ckpt / "step_00000002").exists()


def test_a_checkpoint_directory_the_agent_could_not_be_told_about_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot be reported: field 'path' must be an absolute normalised path"):
        checkpoints(RankCheckpointSettings(directory=Path("/ckpt/../etc")), cells(), Reporter())


def test_a_checkpoint_directory_another_job_saved_into_is_refused_before_a_step(tmp_path: Path) -> None:
    """A job renamed to start afresh with its directory left as it was: saving there would overwrite the
    other job's steps and prune its newest checkpoints."""
    reporter, _ = train(tmp_path, every=1, steps=3)  # job "unit"
    ctx = RankContext.from_environ({"TRAINERD_JOB": "unit2"})
    with pytest.raises(ValueError, match=f"checkpoint directory {tmp_path / 'ckpt'} holds the checkpoints of job "
                                         "'unit' \\(its trainerd-job file\\): give job 'unit2' a checkpoint.dir of its own"):
        TrainingCheckpoints(ctx, RankCheckpointSettings(directory=tmp_path / "ckpt", every=1), Reporter(), cells(),
                            data_seed=SEED, grad_accumulation=2)
    assert sorted(path.name for path in (tmp_path / "ckpt").iterdir()) == [
        "step_00000001", "step_00000002", "step_00000003", "trainerd-job"]  # nothing of the other job's was touched
    train(tmp_path, every=1, steps=1)  # the job that claimed it saves there again


def test_without_a_directory_nothing_is_saved_and_requests_are_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = RankCheckpointSettings(every=1, control_file=tmp_path / "control.json")
    with checkpoints(settings, cells(), Reporter()) as ckpt:
        ckpt.after_step(1, 16)
    assert "no checkpoint directory, so checkpoint requests will be ignored" in caplog.text
    assert list(tmp_path.iterdir()) == []


def flags(checkpoint_dir: str | None = None, checkpoint_every: int | None = None) -> argparse.Namespace:
    return argparse.Namespace(checkpoint_dir=None if checkpoint_dir is None else Path(checkpoint_dir),
                              checkpoint_every=checkpoint_every)


def test_the_example_takes_checkpoint_flags_where_the_launcher_set_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    launcher = RankContext.from_environ({"TRAINERD_CHECKPOINT_DIR": "/ckpt/mlp", "TRAINERD_CHECKPOINT_EVERY": "10"})
    by_hand = RankContext.from_environ({})
    assert checkpoint_settings(flags("ckpt", 5), by_hand) == RankCheckpointSettings(directory=tmp_path / "ckpt", every=5)
    assert checkpoint_settings(flags(), launcher) == launcher.checkpoints
    assert checkpoint_settings(flags("/ckpt/mlp", 10), launcher) == launcher.checkpoints
    with pytest.raises(ValueError, match="--checkpoint-dir /elsewhere disagrees with the launcher's /ckpt/mlp"):
        checkpoint_settings(flags("/elsewhere"), launcher)
    with pytest.raises(ValueError, match="--checkpoint-every 5 disagrees with the launcher's 10"):
        checkpoint_settings(flags(checkpoint_every=5), launcher)
    only_dir = replace(launcher, checkpoints=RankCheckpointSettings(directory=Path("/ckpt/mlp")))
    assert checkpoint_settings(flags(checkpoint_every=5), only_dir).every == 5
