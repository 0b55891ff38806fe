"""proto/launch_env.py is the one place a TRAINERD_* variable is spelled: the coordinator, the agent, the
worker runtime, the CLIs and the benches name each through its constant, so a renamed or new variable cannot
drift between who sets it and who reads it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from proto import launch_env

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("daemon", "agent", "trainer", "common", "proto", "scripts", "bench")
OWNER = REPO / "proto" / "launch_env.py"
NAME = re.compile(r"\bTRAINERD_[A-Z_]+")


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def test_no_product_code_spells_a_trainerd_variable_outside_launch_env() -> None:
    spelled = []
    for package in PRODUCT:
        for path in sorted((REPO / package).rglob("*.py")):
            if path == OWNER:
                continue
            tree = ast.parse(path.read_text(), str(path))
            docstrings = _docstrings(tree)
            spelled += [f"{path.relative_to(REPO)}:{node.lineno}: {node.value[:60]!r}" for node in ast.walk(tree)
                        if isinstance(node, ast.Constant) and isinstance(node.value, str)
                        and id(node) not in docstrings and NAME.search(node.value)]
    assert not spelled, f"TRAINERD_* spelled outside proto/launch_env.py: {spelled}"


def test_every_trainerd_variable_is_named_once() -> None:
    values = [value for name, value in vars(launch_env).items() if name.endswith("_ENV") and isinstance(value, str)]
    assert len(values) == len(set(values))
    assert all(value.startswith(launch_env.TRAINERD_ENV_PREFIX) for value in values)
