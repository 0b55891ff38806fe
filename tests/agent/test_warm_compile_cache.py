"""The compile cache across a cold and a warm start, with real MindSpore: a generation forked from a warm
template (which imported MindSpore before it knew its job) loads the graph the cold first generation
cached, as a second cold start would. MindSpore keys the cache's validity on the entry script it
noted at import (agent/warm_worker.py's docstring); before the warm worker corrected that, the warm
generation found "the compilation dependency files changed", compiled again and overwrote the cache,
so only the third generation at a world size was faster."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

import pytest

from agent.compile_cache import CompileCacheLauncher
from agent.launcher import SubprocessLauncher
from agent.warm_launcher import WarmLauncher

pytestmark = pytest.mark.mindspore  # MindSpore processes: left out of `make test-fast`

PY = sys.executable
REPO = Path(__file__).resolve().parents[2]

# A job that compiles one small graph and prints the files MindSpore checks before it loads a cached one.
JOB = """
import mindspore as ms
import numpy as np
from mindspore import nn
from mindspore.graph import api

ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
net = nn.SequentialCell([nn.Dense(16, 16), nn.ReLU(), nn.Dense(16, 1)])
net(ms.Tensor(np.ones((4, 16), np.float32)))
print("dependencies", api._get_compile_cache_dep_files(), flush=True)
"""


def test_a_warm_started_generation_loads_the_graph_the_cold_one_cached(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "agent.warm_launcher")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "tiny_job.py").write_text(JOB)
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), "RANK_ID": "0",
           "PYTHONPATH": f"{tmp_path / 'lib'}{os.pathsep}{REPO}", "TRAINERD_GENERATION": "1"}
    argv = [PY, "-m", "tiny_job"]
    warm = WarmLauncher(SubprocessLauncher(), python=PY, log_path=tmp_path / "warm_workers.log", capacity=2)
    cold = WarmLauncher(SubprocessLauncher(), python=PY, log_path=tmp_path / "warm_workers.log", capacity=2,
                        enabled=False)
    launchers = {1: CompileCacheLauncher(cold, tmp_path / "cache"), 2: CompileCacheLauncher(warm, tmp_path / "cache")}

    async def generation(number: int) -> str:
        log = tmp_path / f"generation{number}.log"
        handle = await launchers[number].start(argv, {**env, "TRAINERD_GENERATION": str(number)}, tmp_path, log)
        assert await handle.wait() == 0, log.read_text()[-3000:]
        return log.read_text()

    async def scenario() -> tuple[str, list[os.stat_result], str]:
        try:
            first = await generation(1)
            cached = sorted((tmp_path / "cache").glob("*/rank_0/graph_cache/*"))
            before = [path.stat() for path in cached]
            second = await generation(2)
            return first, before, second
        finally:
            await warm.close()

    first, before, second = asyncio.run(asyncio.wait_for(scenario(), 240))
    cached = sorted((tmp_path / "cache").glob("*/rank_0/graph_cache/*"))
    assert [path.name for path in cached] == ["compile_cache_0.mindir", "compile_dependency.hash"]
    assert " cold (warm workers are off)" in caplog.text and " warm (forked from the pre-started" in caplog.text
    dependencies = f"dependencies {[str(tmp_path / 'lib' / 'tiny_job.py')]}"
    assert dependencies in first.splitlines()
    assert dependencies in second.splitlines()  # the job's script, not the warm worker's module
    assert "dependency files are changed" not in second
    # loaded, not compiled and written again
    assert [(s.st_ino, s.st_mtime_ns) for s in before] == [(p.stat().st_ino, p.stat().st_mtime_ns) for p in cached]
