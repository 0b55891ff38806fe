"""`trainerctl checkpoint import` of MindFormers Checkpoint 2.0, with the rank files written by real MindSpore
(`mindspore.save_checkpoint(..., format="safetensors")`, as MindFormers' own save does) and the tracker,
common.json and metadata.json laid out as MindFormers 2.0.0 writes them (mindformers/checkpoint/)."""

from __future__ import annotations

import json
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from click.testing import CliRunner

from daemon.cli.checkpoint_commands import checkpoint
from trainer.checkpoint import load_checkpoint
from trainer.checkpoint.mindformers_import import TRACKER_FILE

RNG = np.random.default_rng(7)
FULL = {
    "embedding.weight": RNG.standard_normal((16, 8)).astype(np.float32),   # split on dim 1 over 2 ranks
    "output.weight": RNG.standard_normal((6, 10)).astype(np.float32),      # split on dim 0 over 2 ranks
    "norm.weight": RNG.standard_normal(8).astype(np.float32),              # whole on each rank
    "adam_m.embedding.weight": RNG.standard_normal((16, 8)).astype(np.float32),
}
SPLIT = {"embedding.weight": 1, "output.weight": 0, "adam_m.embedding.weight": 1}


def _slice(name: str, rank: int) -> tuple[np.ndarray, list[int]]:
    array = FULL[name]
    dim = SPLIT.get(name)
    if dim is None:
        return array, [0] * array.ndim
    size = array.shape[dim] // 2
    offset = [0] * array.ndim
    offset[dim] = rank * size
    return np.take(array, range(rank * size, (rank + 1) * size), axis=dim), offset


def _save(path: Path, tensors: dict[str, np.ndarray]) -> None:
    ms.save_checkpoint([{"name": k, "data": ms.Tensor(v)} for k, v in tensors.items()], str(path),
                       format="safetensors")


def write_iteration(root: Path, iteration: int, commit: bool = True, global_batch: int = 8) -> Path:
    """A 2-rank Checkpoint 2.0 iteration as MindFormers writes it: per-rank model and optimizer files,
    common.json, metadata.json, then (commit) the tracker."""
    directory = root / f"iteration_{iteration:08d}"
    directory.mkdir(parents=True)
    state: dict[str, dict] = {}
    storage: dict[str, list] = {}
    for rank in range(2):
        for kind, names in (("model", [n for n in FULL if not n.startswith("adam")]),
                            ("opt", [n for n in FULL if n.startswith("adam")])):
            file_name = f"CKP-{kind}-{rank:07d}-{2:07d}"
            slices = {name: _slice(name, rank) for name in names}
            _save(directory / file_name, {name: array for name, (array, _) in slices.items()})
            for name, (array, offset) in slices.items():
                entry = state.setdefault(name, {
                    "properties": {"dtype": "Float32", "replica_id": 0, "allow_shape_mismatch": False,
                                   "allow_to_save": True},
                    "global_shape": list(FULL[name].shape), "axis_fragmentations": [1] * array.ndim,
                    "layout": None, "chunk": []})
                chunk = {"global_offset": offset, "local_shape": list(array.shape)}
                if chunk not in entry["chunk"]:
                    entry["chunk"].append(chunk)
                storage.setdefault(str((name, tuple(offset))), []).append(
                    {"file_name": f"{file_name}.safetensors", "storage_rank": rank, "rank_group": [0, 1]})
    (directory / "metadata.json").write_text(json.dumps({"state_dict_metadata": state, "storage_data": storage}))
    (directory / "common.json").write_text(json.dumps({
        "epoch_num": 1, "step_num": iteration, "global_step": iteration, "loss_scale": 1.0,
        "global_batch_size": global_batch, "ckpt_status": None}))
    if commit:
        (root / TRACKER_FILE).write_text(str(iteration))
    return directory


def _run(*args: str | Path) -> tuple[int, str, str]:
    result = CliRunner().invoke(checkpoint, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def mindformers_root(tmp_path: Path) -> Path:
    root = tmp_path / "mf"
    write_iteration(root, 40)
    write_iteration(root, 80)
    return root


def test_a_checkpoint_2_0_imports_at_any_world_size_with_its_step_and_samples(mindformers_root: Path,
                                                                               tmp_path: Path) -> None:
    code, out, err = _run("import", mindformers_root, "--world-size", "3", "--out", tmp_path / "ours")
    assert (code, err) == (0, "")
    assert out.strip() == str(tmp_path / "ours" / "step_00000080"), "the root stands for the committed iteration"
    for rank in range(3):
        loaded, manifest = load_checkpoint(tmp_path / "ours" / "step_00000080", rank, 3)
        assert (manifest.step, manifest.meta.consumed_samples) == (80, 80 * 8)
        assert loaded.keys() == FULL.keys()
        assert all(loaded[name].tobytes() == FULL[name].tobytes() for name in FULL)


def test_an_older_committed_iteration_imports_by_its_directory(mindformers_root: Path, tmp_path: Path) -> None:
    code, out, _ = _run("import", mindformers_root / "iteration_00000040", "--world-size", "1", "--out", tmp_path)
    assert code == 0 and out.strip() == str(tmp_path / "step_00000040")


def test_a_half_written_iteration_is_refused_with_one_line(mindformers_root: Path, tmp_path: Path) -> None:
    write_iteration(mindformers_root, 120, commit=False)
    code, out, err = _run("import", mindformers_root / "iteration_00000120", "--world-size", "2", "--out", tmp_path)
    assert code == 1 and out == ""
    assert err == (f"Error: {mindformers_root / 'iteration_00000120'} is not committed: "
                   f"{mindformers_root / TRACKER_FILE} names iteration 80 (a save cut short leaves such a "
                   "directory)\n")
    (mindformers_root / TRACKER_FILE).unlink()
    code, _, err = _run("import", mindformers_root, "--world-size", "2", "--out", tmp_path)
    assert code == 2 and "no latest_checkpointed_iteration.txt" in err and err.count("\n") == 1


def test_a_one_device_checkpoint_without_metadata_imports_whole_tensors(tmp_path: Path) -> None:
    root = tmp_path / "mf"
    (root / "iteration_00000005").mkdir(parents=True)
    _save(root / "iteration_00000005" / "CKP-model-0000000-0000001", {"norm.weight": FULL["norm.weight"]})
    _save(root / "iteration_00000005" / "CKP-opt-0000000-0000001", {"adam_m.embedding.weight":
                                                                     FULL["adam_m.embedding.weight"]})
    (root / "iteration_00000005" / "common.json").write_text('{"global_step": 5, "global_batch_size": 2}')
    (root / TRACKER_FILE).write_text("5\n")
    code, _, _ = _run("import", root, "--world-size", "2", "--step", "7", "--out", tmp_path / "ours")
    assert code == 0
    loaded, manifest = load_checkpoint(tmp_path / "ours" / "step_00000007", 1, 2)
    assert (manifest.step, manifest.meta.consumed_samples) == (7, 10)
    assert loaded["adam_m.embedding.weight"].tobytes() == FULL["adam_m.embedding.weight"].tobytes()


def test_damaged_metadata_is_refused_with_one_line(mindformers_root: Path, tmp_path: Path) -> None:
    metadata = mindformers_root / "iteration_00000080" / "metadata.json"
    content = json.loads(metadata.read_text())
    del content["storage_data"][str(("output.weight", (3, 0)))]
    metadata.write_text(json.dumps(content))
    code, _, err = _run("import", mindformers_root, "--world-size", "2", "--out", tmp_path)
    assert code == 1 and "no file holds 'output.weight' at offset [3, 0]" in err and err.count("\n") == 1


def test_a_strategy_file_is_refused_for_checkpoint_2_0_and_required_for_rank_directories(
        mindformers_root: Path, tmp_path: Path) -> None:
    strategy = tmp_path / "strategy.json"
    strategy.write_text("{}")
    code, _, err = _run("import", mindformers_root, "--strategy", strategy, "--world-size", "2", "--out", tmp_path)
    assert code == 2 and "drop --strategy" in err
    (tmp_path / "legacy" / "rank_0").mkdir(parents=True)
    code, _, err = _run("import", tmp_path / "legacy", "--world-size", "2", "--out", tmp_path)
    assert code == 2 and "needs --strategy" in err
