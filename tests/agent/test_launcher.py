"""The production launcher with real processes: a new process group each, stdin from /dev/null,
stdout and stderr appended to the log, and an OSError for what cannot be executed."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from agent.launcher import SubprocessLauncher


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped (nobody may reap an orphan in a container)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_output_is_appended_to_the_log_with_the_given_env_cwd_and_no_stdin(tmp_path: Path) -> None:
    log_path = tmp_path / "rank0.log"
    log_path.write_text("from an earlier start\n")
    script = 'echo "$GREETING"; pwd; readlink /proc/self/fd/0; echo oops >&2; exit 3'

    async def scenario() -> int:
        handle = await SubprocessLauncher().start(["/bin/sh", "-c", script], {"GREETING": "hello"}, tmp_path,
                                                  log_path)
        return await handle.wait()

    assert run(scenario()) == 3
    assert log_path.read_text() == f"from an earlier start\nhello\n{tmp_path}\n/dev/null\noops\n"


def test_a_signal_reaches_the_whole_process_group(tmp_path: Path) -> None:
    log_path = tmp_path / "rank0.log"

    async def scenario() -> tuple[int, int]:
        handle = await SubprocessLauncher().start(
            ["/bin/sh", "-c", "sleep 60 & echo $!; wait"], dict(os.environ), tmp_path, log_path)
        assert os.getpgid(handle.pid) == handle.pid  # a group of its own, not the agent's
        while not log_path.read_text().strip():
            await asyncio.sleep(0.01)
        grandchild = int(log_path.read_text())
        assert alive(grandchild)
        handle.signal_group(signal.SIGTERM)
        code = await handle.wait()
        for _ in range(200):
            if not alive(grandchild):
                break
            await asyncio.sleep(0.01)
        handle.signal_group(signal.SIGKILL)  # the group is gone by now: not an error
        return code, grandchild

    code, grandchild = run(scenario())
    assert code == -signal.SIGTERM
    assert not alive(grandchild)


@pytest.mark.parametrize("exists, error", [(False, FileNotFoundError), (True, PermissionError)])
def test_an_entrypoint_that_cannot_be_executed_raises_oserror(tmp_path: Path, exists: bool, error) -> None:
    entrypoint = tmp_path / "train"
    if exists:  # but without the execute bit
        entrypoint.write_text("#!/bin/sh\n")
    with pytest.raises(error):
        run(SubprocessLauncher().start([str(entrypoint)], {}, tmp_path, tmp_path / "rank0.log"))
