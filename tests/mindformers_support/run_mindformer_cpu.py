"""Run a MindFormers runner script on CPU: `python run_mindformer_cpu.py RUNNER.py [runner args...]`.

CPU/test-only (see the package docstring): installs the hyper_parallel stub and the overflow-check patch,
then runs RUNNER.py as `__main__` with the remaining arguments.
"""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cpu_patches  # noqa: E402
import hyper_parallel_stub  # noqa: E402

hyper_parallel_stub.install()
cpu_patches.patch_overflow_check()
runner = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(runner, run_name="__main__")
