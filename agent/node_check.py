"""Running job.node_check on this host when the coordinator asks (a NodeCheck), and the answer.

The check runs like a training process: through the launcher (as the `run_as` user, in its own process
group), only when its argv starts with one of allowed_entrypoints, its output in the agent's work dir
(node_check.log). Exit 0 passes; anything else, a refusal or the timeout fails, with the reason in one line.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from agent.commands import NodeCheck
from agent.launch_policy import entrypoint_refusal
from agent.launcher import ProcessLauncher
from agent.supervisor import expand_argv, log_tail
from proto import trainerd_pb2 as pb

DETAIL_CHARS = 300


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:DETAIL_CHARS] if lines else ""


async def run_node_check(check: NodeCheck, *, launcher: ProcessLauncher, work_dir: Path,
                         allowed_entrypoints: Sequence[Sequence[str]],
                         python: str = sys.executable) -> pb.NodeCheckResult:
    def answer(passed: bool, detail: str = "") -> pb.NodeCheckResult:
        return pb.NodeCheckResult(check_id=check.check_id, passed=passed, detail=detail)

    refusal = entrypoint_refusal(check.argv, allowed_entrypoints)
    if refusal is not None:
        return answer(False, refusal)
    log_path = work_dir / "node_check.log"
    log_path.unlink(missing_ok=True)
    try:
        handle = await launcher.start(expand_argv(check.argv, python), dict(os.environ), work_dir, log_path)
    except OSError as exc:
        return answer(False, f"cannot start {list(check.argv)!r:.200}: {exc.strerror or exc}")
    try:
        async with asyncio.timeout(check.timeout_s):
            code = await handle.wait()
    except TimeoutError:
        handle.signal_group(signal.SIGKILL)
        await handle.wait()
        return answer(False, f"did not finish within {check.timeout_s:.0f}s")
    handle.signal_group(signal.SIGKILL)  # whatever it left behind in its group
    if code == 0:
        return answer(True)
    ended = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    last = _last_line(log_tail(log_path))
    return answer(False, f"{ended}: {last}" if last else ended)
