"""Agents that trainerd starts on its own host (`cluster.local_agents: N`, single-machine mode).

They end with trainerd, even one killed by SIGKILL (common/child_lifetime.py): each then stops its training
processes as when trainerd stops it, rather than live on beside the agents a new trainerd starts under the
same node names."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from common.child_lifetime import ending_with_this_process

log = logging.getLogger(__name__)


class LocalAgents:
    def __init__(self, *, count: int, coordinator_address: str, cluster_name: str, work_root: Path,
                 cpu_devices: int, compile_cache: bool = False, warm_workers: bool = True) -> None:
        self._count = count
        self._coordinator_address = coordinator_address
        self._cluster_name = cluster_name
        self._work_root = work_root
        self._cpu_devices = cpu_devices
        self._compile_cache = compile_cache
        self._warm_workers = warm_workers
        self._processes: list[asyncio.subprocess.Process] = []

    def node_name(self, index: int) -> str:
        return f"{self._cluster_name}-local-{index}"

    async def start(self) -> None:
        for index in range(self._count):
            name = self.node_name(index)
            work_dir = self._work_root / name
            work_dir.mkdir(parents=True, exist_ok=True)
            log_file = open(work_dir / "agent.log", "ab")
            process = await asyncio.create_subprocess_exec(
                *ending_with_this_process([
                    sys.executable, "-m", "agent.main",
                    "--coordinator", self._coordinator_address,
                    "--node-name", name,
                    "--cpu-devices", str(self._cpu_devices),
                    "--work-dir", str(work_dir),
                    *(["--compile-cache"] if self._compile_cache else []),
                    *([] if self._warm_workers else ["--no-warm-workers"]),
                ]),
                stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                start_new_session=True,
            )
            log_file.close()
            self._processes.append(process)
            log.info("started local agent %s (pid %d), log %s", name, process.pid, work_dir / "agent.log")

    async def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every agent (each stops its own workers), SIGKILL what is left after the grace."""
        for process in self._processes:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        for process in self._processes:
            try:
                async with asyncio.timeout(grace_s):
                    await process.wait()
            except TimeoutError:
                log.warning("local agent pid %d ignored SIGTERM; killing its process group", process.pid)
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await process.wait()
        self._processes.clear()
