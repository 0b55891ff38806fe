"""The agents trainerd starts itself (`cluster.local_agents`) run with the cluster file's `local_agent`
settings: a compile cache only where the file turns it on (agent/config.py says why it is off by default), warm
workers unless it turns them off."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from daemon.local_agents import LocalAgents
from tests.ports import free_port
from tests.waiting import wait_until


@pytest.mark.parametrize("compile_cache, warm_workers", [(False, True), (True, False)])
def test_local_agents_get_the_compile_cache_and_warm_workers_as_the_cluster_file_asks(
        tmp_path: Path, compile_cache: bool, warm_workers: bool) -> None:
    async def argv() -> list[str]:
        agents = LocalAgents(count=1, coordinator_address=f"127.0.0.1:{free_port()}", cluster_name="c",
                             work_root=tmp_path, cpu_devices=2, compile_cache=compile_cache,
                             warm_workers=warm_workers)
        await agents.start()
        try:
            (pid,) = [process.pid for process in agents._processes]
            # Until the child has exec'd, its cmdline is still its parent's.
            return wait_until(lambda: "--node-name" in (argv := Path(f"/proc/{pid}/cmdline").read_bytes().decode()
                                                        .split("\0")) and argv, 10, "the agent's own command line")
        finally:
            await agents.stop(grace_s=5)

    command = asyncio.run(argv())
    assert command[command.index("--node-name") + 1] == "c-local-0"
    assert command[command.index("--cpu-devices") + 1] == "2"
    assert ("--compile-cache" in command) is compile_cache
    assert ("--no-warm-workers" in command) is not warm_workers
