"""Which environment variables MindSpore and the trainer runtime read at import (agent/import_env.py).

A fresh interpreter runs the warm worker's preload with every libc getenv() recorded (a shim built
here with the C compiler and LD_PRELOADed) and every os.environ lookup recorded. Every name read
must be one that a warm worker compares with the job's environment; a MindSpore upgrade that reads
a new variable at import fails here until agent/import_env.py lists it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from agent.import_env import read_at_import

HERE = Path(__file__).resolve().parent / "import_env"
REPO = Path(__file__).resolve().parents[2]


def test_every_variable_read_while_importing_mindspore_is_compared(tmp_path: Path) -> None:
    shim, record = tmp_path / "getenv_recorder.so", tmp_path / "read.txt"
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(shim), str(HERE / "getenv_recorder.c"), "-ldl"],
                   check=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "GETENV_RECORD": str(record), "LD_PRELOAD": str(shim)}
    result = subprocess.run([sys.executable, str(HERE / "record_preload.py")], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    read = set(record.read_text().split()) - {"GETENV_RECORD"}
    assert {"DEVICE_ID", "GLOG_v", "MS_ALLOC_CONF", "PYTHONPATH"} <= read  # the recording works
    assert sorted(name for name in read if not read_at_import(name)) == []
    # read only at init() or by the script: a new generation's ports and ranks still find a warm worker
    assert not {"MS_SCHED_HOST", "MS_SCHED_PORT", "MS_ROLE", "MS_NODE_ID", "MS_WORKER_NUM", "RANK_ID",
                "MS_COMPILER_CACHE_ENABLE", "MS_COMPILER_CACHE_PATH"} & read
    assert not any(name.startswith("TRAINERD_") for name in read)
