"""Fixtures of the integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import Processes


@pytest.fixture
def procs(tmp_path: Path):
    processes = Processes(tmp_path)
    yield processes
    processes.cleanup()
