"""trainerd and the agent run gRPC's core with the settings of common/grpc_core_settings.py: the environment
names them when `grpc` is first imported (gRPC reads them then, never again) and not after (the processes
they start get the environment they were given), the installed grpcio still knows every experiment named,
and an operator's own GRPC_EXPERIMENTS is kept."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.grpc_core_settings import GRPC_EXPERIMENTS

REPO = Path(__file__).resolve().parents[1]

# Notes GRPC_EXPERIMENTS as it is when `grpc` is first imported, then makes a channel (gRPC's core logs
# "Unknown experiment" by then for a name it does not know).
PROBE = """
import importlib.abc, os, sys

class NoteGrpcImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "grpc":
            print("at import:", repr(os.environ.get("GRPC_EXPERIMENTS")))
            sys.meta_path.remove(self)
        return None

sys.meta_path.insert(0, NoteGrpcImport())
import {module}
import grpc
grpc.insecure_channel("127.0.0.1:1").close()
print("after:", repr(os.environ.get("GRPC_EXPERIMENTS")))
"""


def probe(module: str, environment: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE.format(module=module)], cwd=REPO, env=environment,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module", ["daemon.cli.trainerd_main", "agent.main"])
def test_grpc_is_first_imported_with_the_experiments_set_and_knows_them_all(module: str) -> None:
    environment = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    result = probe(module, environment)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"at import: {GRPC_EXPERIMENTS!r}", "after: None"]
    assert "Unknown experiment" not in result.stderr


def test_an_operators_own_setting_is_kept() -> None:
    result = probe("agent.main", {**os.environ, "GRPC_EXPERIMENTS": ""})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["at import: ''", "after: ''"]
