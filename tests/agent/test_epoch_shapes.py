"""What each script's output showed of its epochs outlives the agent, and a bad file costs only that."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from agent.epoch_shapes import FILE_NAME, MAX_EPOCH_SHAPES, EpochShapes
from agent.output_progress import EpochShape

KEY = ("job", ("/venv/bin/python", "train.py", "--epochs", "10"), "2")
SHAPE = EpochShape(1, 20, False)


def test_an_agent_started_again_knows_the_shapes_and_keeps_only_the_newest(tmp_path: Path) -> None:
    shapes = EpochShapes(tmp_path)
    shapes.remember(KEY, SHAPE)
    for world_size in range(MAX_EPOCH_SHAPES):
        shapes.remember(("other", ("x",), str(world_size)), EpochShape(0, 5, True))
    shapes.remember(KEY, EpochShape(1, 40, False))  # learnt again (the data grew): the newest
    again = EpochShapes(tmp_path)
    assert again.get(KEY) == EpochShape(1, 40, False)
    assert again.get(("other", ("x",), "0")) is None  # the oldest went first
    assert again.get(("other", ("x",), str(MAX_EPOCH_SHAPES - 1))) == EpochShape(0, 5, True)
    assert len(json.loads((tmp_path / FILE_NAME).read_text())) == MAX_EPOCH_SHAPES


@pytest.mark.parametrize("content", [
    b"not json", b'{"job": "a"}', b"[1]",
    json.dumps([{"job": "j", "argv": ["a"], "world_size": "2", "first_epoch": 2, "steps_per_epoch": 5,
                 "zero_based": False}]).encode(),
    json.dumps([{"job": "j", "argv": ["a"], "world_size": "2", "first_epoch": True, "steps_per_epoch": 5,
                 "zero_based": False}]).encode(),
    json.dumps([{"job": "j", "argv": "a", "world_size": "2", "first_epoch": 1, "steps_per_epoch": 5,
                 "zero_based": False}]).encode(),
])
def test_a_file_this_agent_did_not_write_is_ignored_with_a_warning(tmp_path: Path, content: bytes, caplog) -> None:
    (tmp_path / FILE_NAME).write_bytes(content)
    with caplog.at_level(logging.WARNING, "agent.epoch_shapes"):
        shapes = EpochShapes(tmp_path)
    assert shapes.get(("j", ("a",), "2")) is None
    assert "not what this agent writes" in caplog.text
    shapes.remember(KEY, SHAPE)  # and it is replaced by a good one
    assert EpochShapes(tmp_path).get(KEY) == SHAPE


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_a_fifo_a_symlink_or_a_directory_where_the_file_belongs_is_not_read(tmp_path: Path, kind: str, caplog) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps([{"job": "j", "argv": ["a"], "world_size": "2", "first_epoch": 1,
                                   "steps_per_epoch": 5, "zero_based": False}]))
    path = tmp_path / FILE_NAME
    {"fifo": os.mkfifo, "symlink": lambda p: p.symlink_to(target), "directory": os.mkdir}[kind](path)
    with caplog.at_level(logging.WARNING, "agent.epoch_shapes"):
        shapes = EpochShapes(tmp_path)  # a FIFO would block a plain open
    assert shapes.get(("j", ("a",), "2")) is None and "ignoring" in caplog.text
