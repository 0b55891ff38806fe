"""The entrypoint of a MindFormers job under trainerd: write this generation's YAML, then exec the runner.

    entrypoint: [python, -m, trainer.integrations.mindformers.launch, --config, llama.yaml, --,
                 python, run_mindformer.py, --run_mode, train, --use_parallel, "True"]

Every worker of a generation runs it, and so does the scheduler where the entrypoint is not the agent's own
`{python}` (under `{python}` the scheduler is trainerd's own, trainer/runtime/scheduler.py). It reads what
trainerd decided from the environment the agent gives (world size, TRAINERD_CHECKPOINT_DIR/EVERY/KEEP,
TRAINERD_RESUME_FROM and the samples that checkpoint consumed, TRAINERD_GLOBAL_BATCH/MICRO_BATCH), writes the
generation's YAML (`generation_config`), and execs the command after `--` with `--config <that YAML>
--register_path <REGISTER_DIR>` appended: run_mindformer.py then builds the trainerd callback from the YAML's
`callbacks`.

Run outside trainerd (TRAINERD_JOB unset) it execs the command with the user's YAML and the register path
only, so the same entrypoint runs by hand.

A job that does not run in parallel (`use_parallel` False: MindFormers' default, the YAML's, or the runner's
`--use_parallel False`) never joins a cluster: its one rank trains alone, and a scheduler that runs the
launcher has no cluster to serve: it does not run the runner (that would train a second copy beside the rank,
into the same checkpoint directory) but waits for the generation to end. On more than one rank such a job is
refused: each rank would train alone.

A problem is one line on stderr and exit code 2 (65 when the checkpoint to resume from cannot be read, so that
trainerd resumes from another).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import yaml

from proto.exit_codes import EXIT_CHECKPOINT_UNREADABLE, EXIT_USAGE
from proto.launch_env import CONTROL_FILE_ENV, GENERATION_ENV, JOB_ENV, RESUME_FROM_ENV, RESUME_SAMPLES_ENV
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.mindformers_import import committed_iteration_dir, is_mindformers_checkpoint, read_common
from trainer.integrations.mindformers.generation_config import (
    GenerationConfigError,
    GenerationSettings,
    ResumeCheckpoint,
    absolute_base_configs,
    generation_config,
)
from trainer.runtime.rank_context import RankContextError, trainerd_launch

REGISTER_DIR = Path(__file__).resolve().parent / "register"


class LaunchError(Exception):
    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def resume_source(path: Path, environ: Mapping[str, str]) -> ResumeCheckpoint:
    """What TRAINERD_RESUME_FROM points at: a committed Checkpoint 2.0 iteration, or a legacy rank_N/ directory."""
    try:
        if is_mindformers_checkpoint(path):
            directory = committed_iteration_dir(path)
            _, consumed = read_common(directory)
            return ResumeCheckpoint(directory, "iteration", _consumed(environ, consumed))
    except CheckpointError as exc:
        raise LaunchError(f"cannot resume from {path}: {exc}", EXIT_CHECKPOINT_UNREADABLE) from None
    ranks = [p for p in path.glob("rank_*") if p.is_dir()] if path.is_dir() else []
    if not ranks:
        raise LaunchError(f"{RESUME_FROM_ENV}={path} is neither a MindFormers Checkpoint 2.0 iteration nor a "
                          "directory of rank_N/", EXIT_CHECKPOINT_UNREADABLE)
    if not environ.get(RESUME_SAMPLES_ENV):
        raise LaunchError(f"{RESUME_SAMPLES_ENV} is not set: the samples {path} consumed are unknown")
    return ResumeCheckpoint(path, "ranks", _consumed(environ, None), world_size=len(ranks))


def _consumed(environ: Mapping[str, str], recorded: int | None) -> int:
    """The samples trainerd recorded for the checkpoint (its catalog), else what the checkpoint says."""
    raw = environ.get(RESUME_SAMPLES_ENV)
    if not raw:
        assert recorded is not None
        return recorded
    if not raw.isdigit():
        raise LaunchError(f"{RESUME_SAMPLES_ENV}={raw[:40]!r} is not a number of samples")
    return int(raw)


def settings_from_environ(environ: Mapping[str, str]) -> GenerationSettings | None:
    """This generation's settings, or None when trainerd did not launch the process."""
    try:
        ctx = trainerd_launch(environ)
    except RankContextError as exc:
        raise LaunchError(str(exc)) from None
    if ctx is None:
        return None
    resume = ctx.checkpoints.resume_from
    return GenerationSettings(
        world_size=ctx.world_size,
        checkpoint_dir=ctx.checkpoints.directory,
        checkpoint_every=ctx.checkpoints.every,
        checkpoint_keep=ctx.checkpoints.keep,
        resume=None if resume is None else resume_source(resume, environ),
        global_batch=None if ctx.batch is None else ctx.batch.global_batch,
        micro_batch=None if ctx.batch is None else ctx.batch.micro_batch,
    )


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise LaunchError(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise LaunchError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(config, dict):
        raise LaunchError(f"{path} is not a MindFormers config (a YAML mapping)")
    return config


def write_generation_yaml(config: dict[str, Any], environ: Mapping[str, str]) -> Path:
    """A private file (mode 0600) named after the job, generation and rank, in the directory the agent keeps
    for this generation (that of TRAINERD_CONTROL_FILE; the agent removes it with the generation's other
    files), or in the temporary directory when no agent gave one."""
    role = "scheduler" if environ.get("MS_ROLE") == "MS_SCHED" else f"rank{environ.get('RANK_ID', '0')}"
    prefix = f"trainerd-{environ.get(JOB_ENV, 'job')}-g{environ.get(GENERATION_ENV, '0')}-{role}-"
    control_file = environ.get(CONTROL_FILE_ENV)
    directory = str(Path(control_file).parent) if control_file else None
    try:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=".yaml", dir=directory)
    except OSError as exc:
        raise LaunchError(f"cannot write the generation's YAML in {directory or tempfile.gettempdir()}: "
                          f"{exc.strerror}") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    return Path(name)


def runner_argv(command: Sequence[str], config_path: Path) -> list[str]:
    if not command:
        raise LaunchError("give the MindFormers command after --, e.g. -- python run_mindformer.py --run_mode train")
    if any(arg in ("--config", "--register_path") or arg.startswith(("--config=", "--register_path="))
           for arg in command):
        raise LaunchError("the command after -- must not set --config or --register_path: the launcher does")
    return [*command, "--config", str(config_path), "--register_path", str(REGISTER_DIR)]


def use_parallel(config: Mapping[str, Any], command: Sequence[str]) -> tuple[bool | None, str]:
    """Whether MindFormers' runner will join a cluster, and who says so: the runner's last `--use_parallel`
    (run_mindformer.py's overrides the YAML's), else the YAML's `use_parallel`, else MindFormers' default,
    False. None where only a `base_config` could tell, or the value is one MindFormers itself refuses."""
    given = None
    for at, arg in enumerate(command):
        if arg == "--use_parallel" and at + 1 < len(command):
            given = command[at + 1]
        elif arg.startswith("--use_parallel="):
            given = arg.split("=", 1)[1]
    if given is not None:
        word = given.lower()
        return (word == "true" if word in ("true", "false") else None), f"--use_parallel {given}"
    if "use_parallel" in config:
        value = config["use_parallel"]
        return (value if isinstance(value, bool) else None), f"the YAML's use_parallel: {value}"
    if "base_config" in config:
        return None, "its base_config"
    return False, "MindFormers' default: the YAML sets no use_parallel"


def prepare(user_yaml: Path, command: Sequence[str], environ: Mapping[str, str]) -> list[str] | None:
    """The argv to exec; writes the generation's YAML when trainerd launched this process. None: nothing to
    run, for the scheduler of a job that does not run in parallel."""
    settings = settings_from_environ(environ)
    if settings is None:
        return runner_argv(command, user_yaml.resolve())
    config = _read_yaml(user_yaml)
    parallel, said_by = use_parallel(config, command)
    if parallel is False:
        if settings.world_size > 1:
            raise LaunchError(f"{user_yaml}: use_parallel is False ({said_by}), so each of the {settings.world_size} "
                              f"ranks would train alone: give the runner --use_parallel True (or the YAML "
                              f"use_parallel: True), or run the job on one device")
        if environ.get("MS_ROLE") == "MS_SCHED":
            return None
    try:
        generated = generation_config(config, settings)
    except GenerationConfigError as exc:
        raise LaunchError(f"{user_yaml}: {exc}") from None
    absolute_base_configs(generated, user_yaml.resolve())
    return runner_argv(command, write_generation_yaml(generated, environ))


def _fail(message: str, code: int) -> NoReturn:
    print(f"trainerd MindFormers launcher: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def _serve_nothing() -> NoReturn:
    """The scheduler of a job whose one rank joins no cluster: it lives as the generation's scheduler would,
    until the generation is stopped (SIGTERM, which ends it as it ends MindSpore's scheduler)."""
    print("trainerd MindFormers launcher: use_parallel is False, so the job's one rank trains alone and this "
          "scheduler has no cluster to serve: it waits for the generation to end", flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        signal.pause()


def main(argv: Sequence[str] | None = None) -> NoReturn:
    args = list(sys.argv[1:] if argv is None else argv)
    split = args.index("--") if "--" in args else len(args)
    parser = argparse.ArgumentParser(prog="python -m trainer.integrations.mindformers.launch",
                                     description="Run a MindFormers job under trainerd: write the generation's "
                                                 "YAML, then exec the command after --.")
    parser.add_argument("--config", required=True, type=Path, help="the job's MindFormers YAML")
    options = parser.parse_args(args[:split])
    try:
        argv_out = prepare(options.config, args[split + 1:], os.environ)
    except LaunchError as exc:
        _fail(str(exc), exc.exit_code)
    if argv_out is None:
        _serve_nothing()
    try:
        os.execvp(argv_out[0], argv_out)
    except OSError as exc:
        _fail(f"cannot run {argv_out[0]}: {exc.strerror}", EXIT_USAGE)


if __name__ == "__main__":
    main()
