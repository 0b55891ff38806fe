"""RankContext: what a process launched by the agent (or by hand) learns about its place in the job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer.runtime.rank_context import (
    DEFAULT_CHECKPOINT_KEEP,
    BatchSettings,
    RankCheckpointSettings,
    RankContext,
    RankContextError,
    Role,
)

SCHEDULER_ENV = {
    "MS_ROLE": "MS_SCHED", "MS_SCHED_HOST": "10.0.0.1", "MS_SCHED_PORT": "8118", "MS_WORKER_NUM": "4",
    "MS_NODE_ID": "scheduler", "TRAINERD_JOB": "llm", "TRAINERD_GENERATION": "7",
}
WORKER_ENV = SCHEDULER_ENV | {
    "MS_ROLE": "MS_WORKER", "MS_NODE_ID": "worker-3", "RANK_ID": "3", "RANK_SIZE": "4", "DEVICE_ID": "1",
    "TRAINERD_LOCAL_RANK": "1", "TRAINERD_PROGRESS_SOCKET": "/run/trainerd/progress.sock",
    "TRAINERD_GLOBAL_BATCH": "64", "TRAINERD_MICRO_BATCH": "8", "TRAINERD_GRAD_ACCUM": "2",
    "RANK_TABLE_FILE": "/run/trainerd/rank_table.json",
}


def test_worker_environment_gives_the_full_context() -> None:
    ctx = RankContext.from_environ(WORKER_ENV)
    assert ctx == RankContext(
        role=Role.WORKER, job="llm", generation=7, rank=3, world_size=4, local_rank=1, device_id=1,
        batch=BatchSettings(global_batch=64, micro_batch=8, grad_accum=2),
        progress_socket="/run/trainerd/progress.sock", scheduler_address="10.0.0.1:8118",
    )
    assert not ctx.is_scheduler
    assert ctx.batch is not None and ctx.batch.per_rank == 16


def test_scheduler_needs_no_rank() -> None:
    ctx = RankContext.from_environ(SCHEDULER_ENV)
    assert ctx.is_scheduler
    assert (ctx.rank, ctx.local_rank, ctx.device_id, ctx.world_size) == (None, None, None, 4)


def test_no_ms_role_is_a_standalone_run_by_hand() -> None:
    ctx = RankContext.from_environ({})
    assert (ctx.role, ctx.rank, ctx.world_size, ctx.generation) == (Role.STANDALONE, 0, 1, 0)
    assert ctx.batch is None and ctx.progress_socket is None


def test_standalone_refuses_leftovers_of_a_cluster_launch() -> None:
    with pytest.raises(RankContextError, match="MS_ROLE is not set but RANK_SIZE"):
        RankContext.from_environ({"RANK_SIZE": "8"})


@pytest.mark.parametrize("name", [
    "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_WORKER_NUM", "TRAINERD_JOB", "TRAINERD_GENERATION",
    "RANK_ID", "RANK_SIZE", "DEVICE_ID", "TRAINERD_LOCAL_RANK",
])
def test_a_missing_variable_is_named(name: str) -> None:
    env = {k: v for k, v in WORKER_ENV.items() if k != name}
    with pytest.raises(RankContextError, match=f"^{name} is not set"):
        RankContext.from_environ(env)


@pytest.mark.parametrize(("name", "value", "message"), [
    ("MS_ROLE", "MS_SERVER", "MS_ROLE='MS_SERVER' is neither"),
    ("MS_SCHED_PORT", "http", "MS_SCHED_PORT='http' is not an integer"),
    ("MS_SCHED_PORT", "70000", "MS_SCHED_PORT=70000 must be from 1 to 65535"),
    ("RANK_ID", "4", "RANK_ID=4 must be from 0 to 3"),
    ("RANK_ID", "-1", "RANK_ID=-1 must be from 0 to 3"),
    ("RANK_SIZE", "2", "RANK_SIZE=2 differs from MS_WORKER_NUM=4"),
    ("TRAINERD_GENERATION", "2.5", "TRAINERD_GENERATION='2.5' is not an integer"),
    ("TRAINERD_GRAD_ACCUM", "0", "TRAINERD_GRAD_ACCUM=0 must be at least 1"),
    ("TRAINERD_GLOBAL_BATCH", "96", r"TRAINERD_GLOBAL_BATCH=96 is not .* = 8 × 2 × 4"),
])
def test_a_malformed_variable_is_named(name: str, value: str, message: str) -> None:
    with pytest.raises(RankContextError, match=message):
        RankContext.from_environ(WORKER_ENV | {name: value})


def test_batch_settings_come_all_three_or_none() -> None:
    batch_vars = ("TRAINERD_GLOBAL_BATCH", "TRAINERD_MICRO_BATCH", "TRAINERD_GRAD_ACCUM")
    with pytest.raises(RankContextError, match="TRAINERD_GRAD_ACCUM is not set although"):
        RankContext.from_environ({k: v for k, v in WORKER_ENV.items() if k != "TRAINERD_GRAD_ACCUM"})
    assert RankContext.from_environ({k: v for k, v in WORKER_ENV.items() if k not in batch_vars}).batch is None


def test_batch_for_world_keeps_the_global_batch() -> None:
    assert BatchSettings.for_world(64, 8, 4) == BatchSettings(64, 8, 2)
    assert BatchSettings.for_world(64, 8, 8) == BatchSettings(64, 8, 1)
    with pytest.raises(ValueError, match="global batch 64 is not a multiple of micro batch 8 × 3 ranks"):
        BatchSettings.for_world(64, 8, 3)


CHECKPOINT_ENV = {
    "TRAINERD_CHECKPOINT_DIR": "/ckpt/llm", "TRAINERD_CHECKPOINT_EVERY": "50", "TRAINERD_CHECKPOINT_KEEP": "2",
    "TRAINERD_RESUME_FROM": "/ckpt/llm/step_00000100", "TRAINERD_CONTROL_FILE": "/run/trainerd/control.json",
}


@pytest.mark.parametrize("base", [WORKER_ENV, {}], ids=["worker", "standalone"])
def test_checkpoint_settings_come_from_the_launcher(base: dict[str, str]) -> None:
    assert RankContext.from_environ(base | CHECKPOINT_ENV).checkpoints == RankCheckpointSettings(
        directory=Path("/ckpt/llm"), every=50, keep=2, resume_from=Path("/ckpt/llm/step_00000100"),
        control_file=Path("/run/trainerd/control.json"),
    )


@pytest.mark.parametrize(("value", "every"), [("auto", "auto"), ("12", 12), ("0", 0), ("", 0)])
def test_the_memory_snapshot_interval_is_a_number_of_steps_or_auto(value: str, every: int | str) -> None:
    env = WORKER_ENV | {"TRAINERD_MEMORY_EVERY": value}
    assert RankContext.from_environ(env).checkpoints.memory_every == every


@pytest.mark.parametrize(("value", "host"), [("host", True), ("", False), (None, False)])
def test_the_memory_scope_is_host_or_one_shared_directory(value: str | None, host: bool) -> None:
    env = WORKER_ENV if value is None else WORKER_ENV | {"TRAINERD_MEMORY_SCOPE": value}
    assert RankContext.from_environ(env).checkpoints.memory_scope_host is host


def test_unset_or_empty_checkpoint_variables_mean_none() -> None:
    """No checkpoints, no periodic interval chosen (the script's flag decides), start fresh, no requests."""
    nothing = RankCheckpointSettings(directory=None, every=None, keep=DEFAULT_CHECKPOINT_KEEP, resume_from=None,
                                 control_file=None)
    assert RankContext.from_environ(WORKER_ENV).checkpoints == nothing
    assert RankContext.from_environ(WORKER_ENV | {name: "" for name in CHECKPOINT_ENV}).checkpoints == nothing


@pytest.mark.parametrize(("name", "value", "message"), [
    ("TRAINERD_CHECKPOINT_DIR", "ckpt/llm", "TRAINERD_CHECKPOINT_DIR='ckpt/llm' is not an absolute path"),
    ("TRAINERD_CHECKPOINT_EVERY", "-1", "TRAINERD_CHECKPOINT_EVERY=-1 must be at least 0"),
    ("TRAINERD_CHECKPOINT_EVERY", "often", "TRAINERD_CHECKPOINT_EVERY='often' is not an integer"),
    ("TRAINERD_CHECKPOINT_KEEP", "0", "TRAINERD_CHECKPOINT_KEEP=0 must be at least 1"),
    ("TRAINERD_MEMORY_EVERY", "often", "TRAINERD_MEMORY_EVERY='often' is not an integer"),
    ("TRAINERD_MEMORY_SCOPE", "cluster", "TRAINERD_MEMORY_SCOPE='cluster' is not 'host' or empty"),
])
def test_a_malformed_checkpoint_variable_is_named(name: str, value: str, message: str) -> None:
    with pytest.raises(RankContextError, match=f"^{message}"):
        RankContext.from_environ(WORKER_ENV | {name: value})


def test_pure_modules_do_not_import_mindspore() -> None:
    """The agent and the coordinator import these and must never pay for (or need) MindSpore."""
    code = (
        "import sys, trainer, trainer.runtime, proto.progress_datagram, trainer.runtime.rank_context, "
        "trainer.runtime.progress, trainer.runtime.communication, proto.exit_codes, "
        "trainer.runtime.checkpoint_schedule, trainer.runtime.checkpointing, trainer.runtime.snapshot_interval; "
        "sys.exit('mindspore' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
