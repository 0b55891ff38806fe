"""`trainerctl checkpoint ...`: list, verify, reshard, export and import checkpoints, on files only.

Exit codes follow trainerctl: 0 success, 1 the checkpoint is incomplete or damaged or the operation failed,
2 a usage mistake (a path that is not there, an output that already exists). Errors are one line on stderr.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from functools import wraps
from pathlib import Path
from typing import ParamSpec

import click
from rich.console import Console
from rich.table import Table

from trainer.checkpoint import (
    CheckpointError,
    CheckpointMeta,
    export_safetensors,
    import_native,
    list_checkpoints,
    reshard_checkpoint,
    verify_checkpoint,
    write_resharded,
)
from trainer.checkpoint.layout import TensorLayout
from trainer.checkpoint.manifest import MANIFEST_NAME, parse_step_dir, read_manifest, step_dir_name
from trainer.checkpoint.mindformers_import import import_mindformers, is_mindformers_checkpoint

_P = ParamSpec("_P")


class UsageProblem(click.ClickException):
    exit_code = 2


def _reported(command: Callable[_P, None]) -> Callable[_P, None]:
    """Turns checkpoint and file-system errors into one line on stderr and exit code 1."""

    @wraps(command)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            command(*args, **kwargs)
        except CheckpointError as exc:
            raise click.ClickException(str(exc)) from exc
        except OSError as exc:
            raise click.ClickException(f"{exc.filename}: {exc.strerror}") from exc

    return run


def _existing_dir(path: Path) -> Path:
    if not path.is_dir():
        raise UsageProblem(f"{path} is not a directory")
    return path


def _step_dir(path: Path) -> Path:
    """An existing directory; one that holds step_N directories but is not one (the ROOT `list` takes, or
    the --out of `reshard`) is a usage mistake naming the newest step to give instead."""
    steps = [] if (path / MANIFEST_NAME).exists() else sorted(
        (step, entry) for entry in _existing_dir(path).iterdir()
        if entry.is_dir() and (step := parse_step_dir(entry.name)) is not None)
    if steps:
        raise UsageProblem(f"{path} holds checkpoints, it is not one: name a step directory, such as "
                           f"{steps[-1][1]} (trainerctl checkpoint list {path})")
    return _existing_dir(path)


def _absent(path: Path) -> Path:
    if path.exists():
        raise UsageProblem(f"{path} already exists")
    return path


def _prepare_dtypes(tensors: Mapping[str, TensorLayout]) -> None:
    """numpy has a bfloat16 dtype only once MindSpore is imported (through trainer.checkpoint.mindspore_io)."""
    if any(layout.dtype == "BF16" for layout in tensors.values()):
        try:
            importlib.import_module("trainer.checkpoint.mindspore_io")
        except ImportError as exc:
            raise CheckpointError("this checkpoint holds bfloat16 tensors, which need MindSpore installed") from exc


_DIR = click.Path(path_type=Path, file_okay=False)
_WORLD_SIZE = click.IntRange(min=1, max=1 << 20)


@click.group()
def checkpoint() -> None:
    """Inspect and convert checkpoints on disk (no coordinator needed)."""


@checkpoint.command("list")
@click.argument("root", type=_DIR)
@_reported
def list_command(root: Path) -> None:
    """The checkpoints under ROOT, oldest first; complete means manifest and file sizes check out."""
    table = Table("step", "state", "world size", "consumed samples", "files", "bytes", "path")
    for info in list_checkpoints(_existing_dir(root)):
        manifest = info.manifest
        if manifest is None:
            table.add_row(str(info.step), f"incomplete: {info.problem}", "-", "-", "-", "-", str(info.path))
        else:
            table.add_row(
                str(info.step), "complete", str(manifest.world_size), str(manifest.meta.consumed_samples),
                str(len(manifest.files)), str(manifest.total_bytes), str(info.path),
            )
    Console(width=200).print(table)


@checkpoint.command()
@click.argument("step_dir", type=_DIR)
@_reported
def verify(step_dir: Path) -> None:
    """Exit 0 when STEP_DIR is complete and every byte matches its checksum, else 1 saying what is wrong."""
    manifest = verify_checkpoint(_step_dir(step_dir))
    click.echo(
        f"{step_dir}: complete, step {manifest.step}, {len(manifest.files)} files, "
        f"{manifest.total_bytes} bytes verified ({manifest.digest_algorithm})"
    )


@checkpoint.command()
@click.argument("step_dir", type=_DIR)
@click.option("--world-size", required=True, type=_WORLD_SIZE, help="Ranks of the new checkpoint.")
@click.option("--out", required=True, type=_DIR, help="Root under which step_N is written.")
@_reported
def reshard(step_dir: Path, world_size: int, out: Path) -> None:
    """Rewrite STEP_DIR for WORLD_SIZE ranks as OUT/step_N."""
    manifest = read_manifest(_step_dir(step_dir))
    _prepare_dtypes(manifest.tensors)
    _absent(out / step_dir_name(manifest.step))
    click.echo(str(reshard_checkpoint(step_dir, out, world_size)))


@checkpoint.command()
@click.argument("step_dir", type=_DIR)
@click.option("--out", required=True, type=click.Path(path_type=Path, dir_okay=False),
              help="The single safetensors file to write.")
@_reported
def export(step_dir: Path, out: Path) -> None:
    """Write STEP_DIR as one safetensors file that mindspore.load_checkpoint loads."""
    _prepare_dtypes(read_manifest(_step_dir(step_dir)).tensors)
    _absent(out)
    manifest = export_safetensors(step_dir, out)
    click.echo(f"{out}: {len(manifest.tensors)} tensors of step {manifest.step}")


@checkpoint.command("import")
@click.argument("source", type=_DIR)
@click.option("--strategy", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="ParallelStrategyMap file (protobuf, or JSON when named *.json) of a rank_N/ checkpoint.")
@click.option("--world-size", required=True, type=_WORLD_SIZE, help="Ranks of the new checkpoint.")
@click.option("--step", type=click.IntRange(min=0),
              help="Step to record [default: a MindFormers checkpoint's global step, else 0].")
@click.option("--out", required=True, type=_DIR, help="Root under which step_N is written.")
@_reported
def import_command(source: Path, strategy: Path | None, world_size: int, step: int | None, out: Path) -> None:
    """Convert a MindSpore or MindFormers checkpoint into OUT/step_N.

    SOURCE is a MindFormers Checkpoint 2.0 directory (the one holding latest_checkpointed_iteration.txt, or a
    committed iteration_NNNNNNNN/ in it), or a MindSpore distributed checkpoint (SOURCE/rank_N/*.safetensors, as
    MindFormers' legacy format also writes) with its --strategy file."""
    _existing_dir(source)
    if is_mindformers_checkpoint(source):
        if strategy is not None:
            raise UsageProblem(f"{source} is a MindFormers Checkpoint 2.0 (its metadata.json is the strategy): "
                               "drop --strategy")
        imported = import_mindformers(source)
        directory, tensors = imported.directory, imported.tensors
        meta = CheckpointMeta(step=imported.step if step is None else step,
                              consumed_samples=imported.consumed_samples, data_seed=0)
    else:
        if strategy is None:
            raise UsageProblem(f"{source} is not a MindFormers Checkpoint 2.0 (no latest_checkpointed_iteration.txt):"
                               " a rank_N/ checkpoint needs --strategy")
        native = import_native(source, strategy)
        directory, tensors = native.directory, native.tensors
        meta = CheckpointMeta(step=0 if step is None else step, consumed_samples=0, data_seed=0)
    _prepare_dtypes(tensors)
    _absent(out / step_dir_name(meta.step))
    click.echo(str(write_resharded(directory, tensors, meta, out, world_size)))
