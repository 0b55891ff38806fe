"""A pre-started training interpreter, a template: imports MindSpore and the trainer runtime once, then
forks one process per job the agent hands it.

    {python} -m agent.warm_worker FD [--preload MODULE,...] [--room BLANKS]

The agent (agent/warm_launcher.py) starts it in a new session with the environment and working
directory of the jobs it will run, and keeps the other end of the Unix socket FD (SOCK_SEQPACKET), the
control socket. Start-up (the interpreter, `import mindspore`: about 2 CPU-seconds) happens once per
template, at the lowest priority when the agent can restore it; a fork then costs milliseconds and
memory the processes share until they write to it.

On the control socket the agent sends `fork` with one end of a new socket pair attached (SCM_RIGHTS). The
template forks; the child starts a session of its own (its pid is its process group's id, as for a cold
start) and waits on that socket for its job; the template answers `forked PID` once the child has its
session (a signal to the group PID then reaches it), and `exited PID CODE` when
the child ends (CODE as `os.waitstatus_to_exitcode` gives it: -N for signal N). When the agent closes the
control socket, the template forks no more and exits once its children have ended.

A child's job arrives as one JSON message, `{"argv": [...], "env": {...}, "cwd": "..."}` (argv without the
interpreter: `["-m", MODULE, ...]` or `[SCRIPT, ...]`), with the job's log file descriptor attached
(SCM_RIGHTS); the agent closes its end once the process may start. The child then becomes that job:
the log on stdout and stderr, the job's environment and directory, `sys.argv` and `sys.path[0]` as
`python -m MODULE` or `python SCRIPT` would set them, and the module or script run as `__main__`.
Its exit status is what the same command would give: SystemExit's code, or 1 with the traceback in
the log; it leaves through the interpreter's own exit, so atexit handlers (MindSpore's among them) run.
When its socket closes without a job, it exits 0.

Forked children share the template's state from its imports: Python's `random` reseeds in every child
(CPython does so at fork), NumPy's global generator does not, so a job that draws from it unseeded draws
the same numbers in every process of one template. Jobs seed their generators; MindSpore's are seeded by
`set_seed`.

A child's command line (what `ps` and psutil show) is rewritten in place to the job's, in the room the
agent left for it (a blank `--room` argument; a longer command line is cut). Its /proc/PID/environ
is not: that memory may still be pointed to by what read the environment at import, so it keeps
showing the environment the template was started with (the first generation's on that device);
the job's own environment is in `os.environ` and the C library's, as for a cold start.

MindSpore notes its entry script when it is imported (`mindspore.graph.api.entry_script_path`, from
sys.argv[0], and `sys_path`, sys.path without the script's directory): the compile cache is valid
only while that script and the local modules it imports are unchanged (compile_dependency.hash
beside the cached graph). Imported here, that script would be this module, so a generation started
warm would reject the graph a cold one cached (and cache its own under this module's sources, not
the job's); the worker therefore sets both to what a cold start of the job would have noted
(`note_entry_script`).
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import importlib.util
import json
import os
import runpy
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Sequence

# What every trainerd job imports first; a job that needs more imports it itself, as usual.
PRELOAD = (
    "numpy", "mindspore", "mindspore.nn", "mindspore.ops", "mindspore.communication", "mindspore.dataset",
    "trainer.runtime.communication", "trainer.runtime.checkpointing", "trainer.runtime.guard",
    "trainer.runtime.progress", "trainer.runtime.elastic_dataset", "trainer.runtime.callback",
    "trainer.runtime.rank_context", "trainer.checkpoint.mindspore_io", "trainer.data.sampler",
    "trainer.data.skip_ranges",
)
MAX_JOB_BYTES = 16 * 1024 * 1024


def preload(modules: Sequence[str]) -> str:
    """Import `modules`; a failure is not fatal (the job imports again and fails in its own log): its
    traceback is returned for the job's log, else ""."""
    try:
        for name in modules:
            importlib.import_module(name)
    except BaseException:  # noqa: BLE001 (anything the imports raise: the job will see it again)
        return traceback.format_exc()
    return ""


def receive_job(channel: socket.socket) -> tuple[dict, int] | None:
    """The job and its log's file descriptor, once the agent has closed its end; None without a job."""
    data, fds, _, _ = socket.recv_fds(channel, 65536, 1)
    chunks = [data]
    while True:
        chunk = channel.recv(65536)
        if not chunk:
            break
        chunks.append(chunk)
        if sum(map(len, chunks)) > MAX_JOB_BYTES:
            raise ValueError("the job message is too large")
    if not fds:
        return None
    return json.loads(b"".join(chunks)), fds[0]


def become(job: dict, log_fd: int) -> None:
    """Take on the job's output, environment, directory, argv and import path."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])


def module_file(name: str) -> str | None:
    """The file `python -m name` runs (a package's __main__), or None when it cannot be found (then
    running it fails with the interpreter's own message)."""
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{name}.__main__")
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.has_location else None


def note_entry_script(path: str) -> None:
    """Give MindSpore's graph module, if the preload imported it, the entry script and module path it
    would have noted had it been imported by the job at `path` (see the module docstring)."""
    api = sys.modules.get("mindspore.graph.api")
    if api is None:
        return
    script = os.path.realpath(path)
    search = list(sys.path)
    if os.path.dirname(script) in search:
        search.remove(os.path.dirname(script))
    api.entry_script_path = script  # type: ignore[attr-defined]
    api.sys_path = search  # type: ignore[attr-defined]


def run(argv: list[str]) -> None:
    """Run `argv` (without the interpreter) as `python -m MODULE ...` or `python SCRIPT ...` would."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's file in [0]
        if not sys.flags.safe_path:
            sys.path[0] = os.getcwd()
        origin = module_file(argv[1])
        if origin is not None:
            note_entry_script(origin)
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    if not os.path.isfile(script):
        print(f"{sys.executable}: can't open file {os.path.abspath(script)!r}: [Errno 2] No such file or directory",
              file=sys.stderr)
        raise SystemExit(2)
    sys.argv = list(argv)
    if not sys.flags.safe_path:
        sys.path[0] = os.path.dirname(os.path.realpath(script))
    note_entry_script(script)
    runpy.run_path(script, run_name="__main__")


def option(name: str) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


def rewrite_command_line(argv: Sequence[str]) -> None:
    """Overwrite the memory /proc/self/cmdline shows (the exec-time argv strings, which Python copied
    at start) with `argv`, cut to fit, NUL-padded; argv[0], which the C library's
    program_invocation_name points into, stays as it is."""
    with open("/proc/self/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    # After the ")" field 3 (state) has index 0: fields 48 and 49 (arg_start, arg_end) are 45 and 46.
    arg_start, arg_end = int(fields[45]), int(fields[46])
    with open("/proc/self/cmdline", "rb") as cmdline:
        first = cmdline.read().split(b"\0", 1)[0] + b"\0"
    size = arg_end - arg_start - len(first)
    if size <= 0:
        return
    data = b"".join(a.encode(errors="surrogateescape") + b"\0" for a in argv[1:])[:size - 1]
    ctypes.memmove(arg_start + len(first), data.ljust(size, b"\0"), size)


def serve(control: socket.socket) -> int | None:
    """Fork a child for every `fork` the agent sends, and tell it each child's pid and exit, until the agent
    closes `control` and every child has ended (then None). In a child, returns the descriptor of the
    socket its job arrives on."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    serving = True
    while serving or children:
        watched: list = [control, wake_read] if serving else [wake_read]
        ready, _, _ = select.select(watched, [], [], 5.0)
        if wake_read in ready:
            while True:
                try:
                    if not os.read(wake_read, 512):
                        break
                except BlockingIOError:
                    break
        if serving and control in ready:
            try:
                data, fds, _, _ = socket.recv_fds(control, 64, 1)
            except OSError:
                data, fds = b"", []
            if data != b"fork" or len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                serving = False  # the agent closed its end (or broke the protocol): fork no more
            else:
                led_read, led_write = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.setsid()
                    os.close(led_read)
                    os.close(led_write)  # the template reads EOF: this child leads its own group now
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(wake_read)
                    os.close(wake_write)
                    control.close()
                    return fds[0]
                os.close(fds[0])
                os.close(led_write)
                _wait_for_eof(led_read)
                children.add(pid)
                # Only now: the agent signals a child's group (its pid), which a child still in the template's
                # group would not be in, so that a Stop sent at once would miss it.
                _tell(control, f"forked {pid}")
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            _tell(control, f"exited {pid} {os.waitstatus_to_exitcode(status)}")
    return None


def _wait_for_eof(fd: int, timeout_s: float = 10.0) -> None:
    """Read `fd` until its writers have closed it (or `timeout_s` passed), then close it."""
    try:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0 and select.select([fd], [], [], left)[0]:
            if not os.read(fd, 64):
                return
    finally:
        os.close(fd)


def _tell(control: socket.socket, message: str) -> None:
    """A report to the agent; one that has gone away is told nothing (its children go on)."""
    try:
        control.send(message.encode())
    except OSError:
        pass


def main() -> None:
    fd = int(sys.argv[1])
    modules = option("--preload")
    failed_preload = preload(PRELOAD if modules is None else [m for m in modules.split(",") if m])
    # What the imports made stays shared with the children: the collector leaves it alone in them, rather
    # than touching (and so copying) every page of it at their first collection.
    gc.freeze()
    with socket.socket(fileno=fd) as control:
        job_fd = serve(control)
    if job_fd is None:
        return
    with socket.socket(fileno=job_fd) as channel:
        received = receive_job(channel)
    if received is None:
        return
    job, log_fd = received
    become(job, log_fd)
    rewrite_command_line([sys.executable, *job["argv"]])
    if failed_preload:
        print(f"trainerd: the warm worker's imports failed before this job:\n{failed_preload}", file=sys.stderr)
    run(job["argv"])


if __name__ == "__main__":
    main()
