"""This suite runs against MindFormers 2.0.0 itself, which `make test`'s venv does not install (pip cannot
resolve it: docs/jobs/mindformers.md); `make test-mindformers` builds the venv that has it. Without it the run
fails with one line: these tests are never skipped. (The folder is not named `mindformers`: on pytest's
sys.path that would shadow the package.)"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

from tests.mindformers_support import hyper_parallel_stub

# MindFormers writes logs (./output) and copies auto_register modules (./modules) into the working directory,
# from these variables read at import; point them at a directory of this session's (runners inherit them).
_scratch = tempfile.mkdtemp(prefix="trainerd-mindformers-tests-")
atexit.register(shutil.rmtree, _scratch, ignore_errors=True)
os.environ["LOCAL_DEFAULT_PATH"] = os.path.join(_scratch, "output")
os.environ["OM_MODULES_CACHE"] = os.path.join(_scratch, "modules")
hyper_parallel_stub.install()
try:
    import mindformers.tools.register  # noqa: F401
except ImportError as exc:
    pytest.exit(f"tests/mindformers_real needs MindFormers 2.0.0 ({exc}): run `make test-mindformers`", returncode=1)
