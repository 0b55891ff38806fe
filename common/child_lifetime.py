"""Children that must not outlive the process that started them: the embedded etcd and the local agents.

A trainerd killed by SIGKILL runs no clean-up. Its etcd would live on holding its ports, and its local
agents would live on beside the ones a new trainerd starts under the same node names. Linux can send a
child a signal when its parent dies (PR_SET_PDEATHSIG); `end_with_parent` asks for SIGTERM, so each ends as
it does when trainerd stops it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_LIBC = ctypes.CDLL(None, use_errno=True)


def end_with_parent() -> Callable[[], None]:
    """A `preexec_fn` for subprocess: the child gets SIGTERM when this process dies. Start children from the
    thread that lives as long as the process (the main thread, where trainerd's event loop runs): the kernel
    signals when the thread that forked ends."""
    return functools.partial(_ask_for_sigterm, os.getpid())


def _ask_for_sigterm(parent: int) -> None:
    """In the child, before it execs."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)
