"""Children that must not outlive the process that started them: the embedded etcd and the local agents.

A trainerd killed by SIGKILL runs no clean-up. Its etcd would live on holding its ports (the next
trainerd's etcd then fails to bind while the orphan answers for it), and its local agents would live on
beside the ones a new trainerd starts under the same node names. Linux sends a child a signal of its
choice when its parent dies (PR_SET_PDEATHSIG); these children ask for SIGTERM, so each ends as it does
when trainerd stops it (etcd closes its store, an agent stops its training processes first).

The child asks in a few lines of Python run with `python -S -c`, which then exec the program: the
attribute survives exec (for a program that is not set-user-id) and is not passed to the program's own
children. Not in a `preexec_fn`: that makes `subprocess` fork the parent rather than vfork it, and so run
the at-fork handlers of everything the parent imported in the child; gRPC's aborted an etcd child there
once in CI before it could exec ("epoll_wait error: Bad file descriptor").

The kernel sends the signal when the thread that forked the child ends, not the process: such children
are started from the main thread, where trainerd's event loop runs.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Sequence

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# argv[1]: the parent's pid, argv[2:]: the program and its arguments. Exit 1, as a program that could not
# start, when the parent died before the prctl (the child then already has another parent).
_TRAMPOLINE = (
    "import ctypes, os, sys\n"
    f"ctypes.CDLL(None).prctl({_PR_SET_PDEATHSIG}, {int(signal.SIGTERM)})\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def ending_with_this_process(argv: Sequence[str]) -> list[str]:
    """`argv` (its program named by path) as a command whose process gets SIGTERM when this one dies.

    Raises:
        RuntimeError: called outside the main thread, whose end (not the process's) would signal the child.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("children that end with trainerd must be started from its main thread")
    return [sys.executable, "-S", "-c", _TRAMPOLINE, str(os.getpid()), *argv]
