"""The environment variables a warm worker has already read before it is handed a job.

A warm worker (agent/warm_worker.py) imports MindSpore and the trainer runtime long before it knows
its job. Whatever the interpreter, MindSpore, its libraries or the runtime read from the environment
during that start-up is fixed by then: giving the job a different value later changes nothing, so
a warm worker may run a job only when every such variable has the same value (or is unset in both)
in its own environment and in the job's (`import_env_mismatch`).

How the list was found (MindSpore 2.10.0, Python 3.11, CPU): tests/agent/test_import_env.py starts a
fresh interpreter that runs the warm worker's preload with every libc getenv() recorded (an
LD_PRELOAD shim) and every os.environ lookup recorded, and fails when a name read there is not
covered by `IMPORT_TIME_VARIABLES` or `IMPORT_TIME_PREFIXES`. It found, among others, DEVICE_ID,
GLOG_v and the other glog flags, MS_ALLOC_CONF, MS_SIMULATION_LEVEL, MS_DEV_*, OMP_* and
OPENBLAS_*: one warm worker per device, started with that device's environment. MS_SCHED_HOST,
MS_SCHED_PORT, MS_ROLE, MS_NODE_ID, MS_WORKER_NUM, RANK_ID and every TRAINERD_* variable are read
only later (at `init()` or by the script), so a new generation's ports and ranks do not prevent
the reuse. The prefixes cover whole families (the interpreter's PYTHON*, the loader's LD_*) so that
a flag of the family that the run above did not happen to ask for is compared too. On Ascend hosts
the backend plug-in loads at import as well; the test has only been run on the CPU build, so
ASCEND_* and HCCL_* are compared as a precaution (run the test there to complete the list).
"""

from __future__ import annotations

from collections.abc import Mapping

IMPORT_TIME_PREFIXES = (
    "PYTHON", "LD_", "GLOG_", "GOOGLE_", "OMP_", "GOMP_", "KMP_", "OPENBLAS_", "GOTO", "MKL_", "NPY_",
    "NUMPY_", "MS_DEV_", "OPENCV_", "GFORTRAN_", "ACC_", "PILLOW_", "SCIPY_", "OMPI_", "LC_",
    # not seen on this CPU build; the Ascend plug-in and CANN libraries load at import there
    "ASCEND_", "HCCL_",
)

IMPORT_TIME_VARIABLES = frozenset({
    # MindSpore
    "DEVICE_ID", "MS_SIMULATION_LEVEL", "MS_ALLOC_CONF", "MS_SUBMODULE_LOG_v", "MS_CACHE_HOST", "MS_CACHE_PORT",
    "MS_AUTO_DYNAMIC_SHAPE_ENABLE", "MS_ENABLE_TFT", "MS_ENABLE_THM", "MS_PROFILER_OPTIONS", "HCCL_CONNECT_TIMEOUT",
    "VLOG_v", "CUDA_HOME", "logger_backupCount", "logger_maxBytes",
    # protobuf, OpenSSL, gRPC, psutil, util-linux (lscpu) as loaded by MindSpore
    "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "TEMPORARILY_DISABLE_PROTOBUF_VERSION_CHECK", "OPENSSL_CONF",
    "OPENSSL_ia32cap", "GRPC_THREAD_POOL_VERBOSE_FAILURES", "PSUTIL_DEBUG", "PSUTIL_TESTING", "LSCPU_DEBUG",
    "LIBSMARTCOLS_DEBUG", "LIBSMARTCOLS_DEBUG_PADDING", "ULPATH_DEBUG",
    # the interpreter, the C library and the process's identity
    "_PYTHON_PROJECT_BASE", "_PYTHON_SYSCONFIGDATA_NAME", "__PYVENV_LAUNCHER__", "HOME", "USER", "PATH", "LANG",
    "TMPDIR", "TEMP", "TMP", "TEST_TMPDIR", "SQLITE_TMPDIR", "TERM", "COLUMNS", "LINES",
})


def read_at_import(name: str) -> bool:
    return name in IMPORT_TIME_VARIABLES or name.startswith(IMPORT_TIME_PREFIXES)


def import_env_mismatch(warm_env: Mapping[str, str], job_env: Mapping[str, str]) -> list[str]:
    """The variables read at import whose values differ between the two environments, sorted."""
    names = {n for n in (*warm_env, *job_env) if read_at_import(n)}
    return sorted(n for n in names if warm_env.get(n) != job_env.get(n))
