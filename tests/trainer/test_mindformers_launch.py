"""The MindFormers launcher: the environment trainerd gives a generation in, the runner's argv and YAML out.
Pure: no MindFormers and no MindSpore (the callback's registration file is only read)."""

from __future__ import annotations

import json
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from proto.exit_codes import EXIT_CHECKPOINT_UNREADABLE, EXIT_USAGE
from trainer.checkpoint.mindformers_import import TRACKER_FILE
from trainer.integrations.mindformers.generation_config import CALLBACK_AUTO_REGISTER, CALLBACK_TYPE
from trainer.integrations.mindformers.launch import REGISTER_DIR, LaunchError, prepare, use_parallel

USER = {
    "use_parallel": True,
    "runner_config": {"batch_size": 2, "gradient_accumulation_steps": 1},
    "parallel_config": {"data_parallel": 2},
    "callbacks": [{"type": "MFLossMonitor"}],
}
RUNNER = ["python", "run_mindformer.py", "--run_mode", "train"]


def worker_env(tmp_path: Path, world_size: int, rank: int = 0, role: str = "MS_WORKER", **extra: str) -> dict[str, str]:
    generation_dir = tmp_path / "generations" / "000003"  # the agent's, where it writes control.json
    generation_dir.mkdir(parents=True, exist_ok=True)
    return {
        "MS_ROLE": role, "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": "8118",
        "MS_WORKER_NUM": str(world_size), "RANK_SIZE": str(world_size), "RANK_ID": str(rank),
        "MS_NODE_ID": str(rank), "DEVICE_ID": "0", "TRAINERD_LOCAL_RANK": str(rank), "TRAINERD_JOB": "llm",
        "TRAINERD_GENERATION": "3", "TRAINERD_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "TRAINERD_CHECKPOINT_EVERY": "50", "TRAINERD_CHECKPOINT_KEEP": "2",
        "TRAINERD_CONTROL_FILE": str(generation_dir / "control.json"), **extra,
    }


def committed(root: Path, iteration: int, global_batch: int = 4, commit: bool = True) -> Path:
    directory = root / f"iteration_{iteration:08d}"
    directory.mkdir(parents=True)
    (directory / "common.json").write_text(json.dumps({"global_step": iteration, "global_batch_size": global_batch}))
    if commit:
        (root / TRACKER_FILE).write_text(str(iteration))
    return directory


@pytest.fixture
def user_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "llama.yaml"
    path.write_text(yaml.safe_dump(USER))
    return path


def generated(argv: list[str]) -> tuple[Path, dict]:
    assert argv[:len(RUNNER)] == RUNNER
    assert argv[len(RUNNER):][0::2] == ["--config", "--register_path"]
    path = Path(argv[len(RUNNER) + 1])
    assert argv[-1] == str(REGISTER_DIR)
    return path, yaml.safe_load(path.read_text())


def test_a_resumed_generation_at_a_smaller_world_size(tmp_path: Path, user_yaml: Path) -> None:
    iteration = committed(tmp_path / "ckpt", 30)
    env = worker_env(tmp_path, 1, TRAINERD_RESUME_FROM=str(iteration), TRAINERD_RESUME_SAMPLES="120")
    path, config = generated(prepare(user_yaml, RUNNER, env))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.name.startswith("trainerd-llm-g3-rank0-")
    assert path.parent == tmp_path / "generations" / "000003"  # removed with the generation, not left in /tmp
    assert config["parallel_config"]["data_parallel"] == 1
    assert config["runner_config"]["gradient_accumulation_steps"] == 2
    assert config["checkpoint"] == {"save_path": str(tmp_path / "ckpt"), "save_interleaved_steps": 50, "save_max": 2,
                                    "load_path": str(iteration), "no_load_optim": False}
    assert config["data_skip_steps"] == 30
    assert config["callbacks"][-1] == {"type": CALLBACK_TYPE, "auto_register": CALLBACK_AUTO_REGISTER,
                                       "global_batch_size": 4, "skip_norm_threshold": None, "initial_step": 30}


def test_without_trainerds_sample_count_the_checkpoint_says_how_far_it_got(tmp_path: Path, user_yaml: Path) -> None:
    committed(tmp_path / "ckpt", 30)
    env = worker_env(tmp_path, 2, rank=1, TRAINERD_RESUME_FROM=str(tmp_path / "ckpt"))
    _, config = generated(prepare(user_yaml, RUNNER, env))
    assert config["checkpoint"]["load_path"] == str(tmp_path / "ckpt" / "iteration_00000030")
    assert config["data_skip_steps"] == 30


def test_a_half_written_iteration_is_not_resumed_from(tmp_path: Path, user_yaml: Path) -> None:
    committed(tmp_path / "ckpt", 30)
    cut_short = committed(tmp_path / "ckpt", 40, commit=False)
    with pytest.raises(LaunchError, match="is not committed") as caught:
        prepare(user_yaml, RUNNER, worker_env(tmp_path, 2, TRAINERD_RESUME_FROM=str(cut_short)))
    assert caught.value.exit_code == EXIT_CHECKPOINT_UNREADABLE


def test_outside_trainerd_the_users_yaml_runs_as_it_is(user_yaml: Path) -> None:
    assert prepare(user_yaml, RUNNER, {}) == [*RUNNER, "--config", str(user_yaml.resolve()),
                                              "--register_path", str(REGISTER_DIR)]


def test_the_register_path_holds_the_module_auto_register_names() -> None:
    module, class_name = CALLBACK_AUTO_REGISTER.split(".")
    source = (REGISTER_DIR / f"{module}.py").read_text()
    assert f"import {class_name}" in source


@pytest.mark.parametrize("args, message", [
    (["--config", "{tmp}/missing.yaml", "--", "true"], "cannot read {tmp}/missing.yaml: No such file or directory"),
    (["--config", "{tmp}/llama.yaml", "--", "python", "run.py", "--config", "x.yaml"],
     "must not set --config or --register_path"),
    (["--config", "{tmp}/llama.yaml"], "give the MindFormers command after --"),
])
def test_mistakes_are_one_line_and_exit_2(tmp_path: Path, user_yaml: Path, args: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "trainer.integrations.mindformers.launch",
                           *[a.format(tmp=tmp_path) for a in args]], env=worker_env(tmp_path, 2),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_USAGE
    assert done.stderr.startswith("trainerd MindFormers launcher: ") and done.stderr.count("\n") == 1
    assert message.format(tmp=tmp_path) in done.stderr


def test_a_world_size_the_global_batch_does_not_allow_is_one_line(tmp_path: Path, user_yaml: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "trainer.integrations.mindformers.launch", "--config",
                           str(user_yaml), "--", "true"], env=worker_env(tmp_path, 3), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == EXIT_USAGE
    assert done.stderr == (f"trainerd MindFormers launcher: {user_yaml}: global batch 4 is not a multiple of "
                           "batch_size 2 × data_parallel 3 at world size 3: choose world sizes that divide it "
                           "(job.world_sizes)\n")


@pytest.mark.parametrize("config, command, expected", [
    ({}, RUNNER, False),  # MindFormers' default
    ({"use_parallel": True}, RUNNER, True),
    ({"use_parallel": True}, [*RUNNER, "--use_parallel", "False"], False),  # the runner's flag wins
    ({"use_parallel": False}, [*RUNNER, "--use_parallel=true"], True),
    ({"use_parallel": False}, [*RUNNER, "--use_parallel", "False", "--use_parallel", "True"], True),  # the last
    ({"base_config": "base.yaml"}, RUNNER, None),  # only the base config can tell
    ({}, [*RUNNER, "--use_parallel", "yes"], None),  # MindFormers refuses it itself
    ({"use_parallel": "maybe"}, RUNNER, None),
])
def test_whether_the_runner_runs_in_parallel(config: dict, command: list[str], expected: bool | None) -> None:
    assert use_parallel(config, command)[0] is expected


def test_a_job_not_in_parallel_on_several_ranks_is_one_line_before_mindformers_starts(tmp_path: Path) -> None:
    user = tmp_path / "llama.yaml"
    user.write_text(yaml.safe_dump({**USER, "use_parallel": True}))
    done = subprocess.run([sys.executable, "-m", "trainer.integrations.mindformers.launch", "--config", str(user), "--",
                           *RUNNER, "--use_parallel", "False"], env=worker_env(tmp_path, 2), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == EXIT_USAGE
    assert done.stderr == (f"trainerd MindFormers launcher: {user}: use_parallel is False (--use_parallel False), so "
                           f"each of the 2 ranks would train alone: give the runner --use_parallel True (or the YAML "
                           f"use_parallel: True), or run the job on one device\n")


def test_the_one_rank_of_a_job_not_in_parallel_trains_and_its_scheduler_runs_nothing(tmp_path: Path) -> None:
    """A scheduler that ran the runner would train a second copy of the job beside the rank, saving into the
    same checkpoint directory (a single-device MindFormers YAML under trainerd did)."""
    user = tmp_path / "llama.yaml"
    user.write_text(yaml.safe_dump({k: v for k, v in USER.items() if k != "use_parallel"}))
    assert prepare(user, RUNNER, worker_env(tmp_path, 1)) is not None
    assert prepare(user, RUNNER, worker_env(tmp_path, 1, role="MS_SCHED")) is None

    ran = tmp_path / "the runner ran"
    scheduler = subprocess.Popen([sys.executable, "-m", "trainer.integrations.mindformers.launch", "--config",
                                  str(user), "--", "/bin/sh", "-c", f"touch '{ran}'"],
                                 env=worker_env(tmp_path, 1, role="MS_SCHED"), stdout=subprocess.PIPE, text=True)
    try:
        assert scheduler.stdout is not None
        assert "this scheduler has no cluster to serve: it waits for the generation to end" in scheduler.stdout.readline()
        with pytest.raises(subprocess.TimeoutExpired):
            scheduler.wait(timeout=1)
        scheduler.send_signal(signal.SIGTERM)  # the generation's stop
        assert scheduler.wait(timeout=10) == -signal.SIGTERM
    finally:
        scheduler.kill()
        scheduler.wait(timeout=10)
    assert not ran.exists()
    assert list((tmp_path / "generations" / "000003").glob("*-scheduler-*.yaml")) == []  # nor its YAML
