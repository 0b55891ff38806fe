"""`trainerctl checkpoint list|verify|reshard|export` on files: exit codes and one-line errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file

from daemon.cli.checkpoint_commands import checkpoint
from trainer.checkpoint import load_checkpoint


@pytest.fixture
def root(tmp_path: Path, tensors: dict[str, np.ndarray], save_all: Callable[..., Path]) -> Path:
    save_all(tmp_path / "ckpt", tensors, 2, step=10)
    save_all(tmp_path / "ckpt", tensors, 2, step=20)
    return tmp_path / "ckpt"


def _run(*args: str | Path) -> tuple[int, str, str]:
    result = CliRunner().invoke(checkpoint, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def test_list_shows_each_checkpoint_and_what_is_wrong_with_incomplete_ones(root: Path) -> None:
    (root / "step_00000030").mkdir()
    code, out, _ = _run("list", root)
    assert code == 0
    # A row starts with its step (the path column is cut to the terminal's width, so it cannot be matched).
    lines = [line for line in out.splitlines() if re.match(r"│ \d+ +│", line)]
    assert [line.split()[1] for line in lines] == ["10", "20", "30"]
    assert "complete" in lines[0] and "640" in lines[0] and "│ 2 " in lines[0]
    assert "incomplete: step_00000030/manifest.json is missing" in lines[2]


def test_verify_exits_0_when_every_digest_matches_else_1_with_one_line(root: Path) -> None:
    code, out, _ = _run("verify", root / "step_00000020")
    assert code == 0 and "complete, step 20, 2 files" in out
    with open(root / "step_00000020" / "rank_1.safetensors", "r+b") as f:
        f.seek(-4000, os.SEEK_END)  # in the data, which ends the file
        f.write(b"\xff\xfe")
    code, out, err = _run("verify", root / "step_00000020")
    assert code == 1 and out == ""
    expected = r"Error: step_00000020/rank_1.safetensors: key '.*' segment \d+: checksum does not match the manifest"
    assert re.fullmatch(expected + r" \(damaged\)\n", err)


def test_reshard_and_export_write_loadable_output(root: Path, tensors: dict[str, np.ndarray], tmp_path: Path) -> None:
    code, out, _ = _run("reshard", root / "step_00000020", "--world-size", "3", "--out", tmp_path / "r3")
    assert code == 0 and out.strip() == str(tmp_path / "r3" / "step_00000020")
    loaded, manifest = load_checkpoint(tmp_path / "r3" / "step_00000020", 0, 1)
    assert manifest.world_size == 3 and all(loaded[k].tobytes() == v.tobytes() for k, v in tensors.items())
    code, _, _ = _run("export", tmp_path / "r3" / "step_00000020", "--out", tmp_path / "model.safetensors")
    assert code == 0
    assert all(a.tobytes() == tensors[k].tobytes() for k, a in load_file(tmp_path / "model.safetensors").items())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["verify", "{root}/step_00000099"], "step_00000099 is not a directory"),
        (["reshard", "{root}/step_00000020", "--world-size", "2", "--out", "{root}"], "step_00000020 already exists"),
        (["export", "{root}/step_00000020", "--out", "{root}/step_00000010/manifest.json"], "already exists"),
        (["list", "{root}/nothing"], "nothing is not a directory"),
        (["verify", "{root}"], "ckpt holds checkpoints, it is not one: name a step directory, such as "
                               "{root}/step_00000020 (trainerctl checkpoint list {root})"),
        (["export", "{root}", "--out", "{root}/model.safetensors"], "ckpt holds checkpoints, it is not one"),
        (["reshard", "{root}", "--world-size", "2", "--out", "{root}/r2"], "ckpt holds checkpoints, it is not one"),
    ],
)
def test_usage_mistakes_exit_2_with_one_line(root: Path, args: list[str], message: str) -> None:
    code, _, err = _run(*[a.format(root=root) for a in args])
    assert code == 2 and message.format(root=root) in err and err.count("\n") == 1


def test_trainerctl_runs_the_group_as_a_real_command(root: Path) -> None:
    trainerctl = Path(sys.executable).with_name("trainerctl")
    os.truncate(root / "step_00000020" / "rank_0.safetensors", 1000)
    done = subprocess.run(
        [trainerctl, "checkpoint", "verify", root / "step_00000020"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("Error: step_00000020/rank_0.safetensors is 1000 bytes, the manifest says")
    assert done.stderr.count("\n") == 1


def test_the_package_and_the_commands_do_not_import_mindspore() -> None:
    """The coordinator and trainerctl use them on hosts without MindSpore."""
    code = "import sys, trainer.checkpoint, daemon.cli.checkpoint_commands; sys.exit('mindspore' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
