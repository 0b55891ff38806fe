"""Running the built-in example job as real MindSpore processes on the CPU, launched the way the agent does:
no msrun; for data parallel one scheduler and one process per rank, each given the dynamic-cluster
environment by hand; a real progress receiver listening on the socket the processes report to."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from agent.progress_receiver import open_progress_receiver
from proto.progress_datagram import (
    CheckpointReport,
    EventReport,
    ProgressMessage,
    StepReport,
)
from tests.harness import Proc, Processes

GLOBAL_BATCH = 64
RUN_TIMEOUT_S = 90
EXAMPLE = [sys.executable, "-m", "trainer.examples.mlp"]
# What the agent sets for speed (daemon/job/launch_plan.py DEFAULT_ENV): quiet logs, fast retries while the cluster forms.
FAST_START_ENV = {"GLOG_v": "3", "MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1"}


@dataclass
class Run:
    procs: dict[str, Proc]
    reports: list[ProgressMessage]
    output: Path
    logs: str

    def steps(self, rank: int) -> list[StepReport]:
        return [m for m in self.reports if isinstance(m, StepReport) and m.rank == rank]

    def events(self, rank: int) -> list[EventReport]:
        return [m for m in self.reports if isinstance(m, EventReport) and m.rank == rank]

    def checkpoints(self) -> list[CheckpointReport]:
        return [m for m in self.reports if isinstance(m, CheckpointReport)]

    def weights(self, rank: int) -> dict[str, np.ndarray]:
        with np.load(self.output / f"final_rank{rank}.npz") as saved:
            return {name: saved[name] for name in saved.files}

    def exit_codes(self) -> dict[str, int]:
        return {name: proc.wait(timeout=1) for name, proc in self.procs.items()}


def cluster_env(socket_path: Path, port: int, world_size: int = 2, generation: int = 1,
                extra: dict[str, str] | None = None) -> dict[str, dict[str, str]]:
    """Per-process environment, as trainerd's launch plan builds it for job "mlp" (`extra` goes to all)."""
    common = FAST_START_ENV | {
        "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": str(port), "MS_WORKER_NUM": str(world_size),
        "RANK_SIZE": str(world_size), "TRAINERD_JOB": "mlp", "TRAINERD_GENERATION": str(generation),
        "TRAINERD_PROGRESS_SOCKET": str(socket_path), "TRAINERD_GLOBAL_BATCH": str(GLOBAL_BATCH),
        "TRAINERD_MICRO_BATCH": str(GLOBAL_BATCH // world_size), "TRAINERD_GRAD_ACCUM": "1",
    } | (extra or {})
    envs = {"scheduler": common | {"MS_ROLE": "MS_SCHED", "RANK_ID": "0", "TRAINERD_LOCAL_RANK": "-1"}}
    for rank in range(world_size):
        envs[f"rank{rank}"] = common | {
            "MS_ROLE": "MS_WORKER", "MS_NODE_ID": str(rank), "RANK_ID": str(rank), "DEVICE_ID": str(rank),
            "TRAINERD_LOCAL_RANK": str(rank),
        }
    return envs


async def run_example(processes: Processes, root: Path, envs: dict[str, dict[str, str]], argv: list[str],
                      until: Callable[[list[ProgressMessage]], bool] | None = None,
                      on_message: Callable[[ProgressMessage], None] | None = None,
                      command: list[str] = EXAMPLE) -> tuple[dict[str, Proc], list[ProgressMessage]]:
    """Start `command` + `argv` (by default the example job) once per entry of `envs` with a progress
    receiver listening on root/progress.sock, and wait (bounded) until all have exited, or until
    `until(reports)` holds. `on_message` sees each report the moment it arrives."""
    reports: list[ProgressMessage] = []

    def receive(message: ProgressMessage, sender_pid: int) -> None:
        reports.append(message)
        if on_message is not None:
            on_message(message)

    receiver = await open_progress_receiver(root / "progress.sock", receive)
    try:
        procs = {name: processes.start(name, command + argv, env) for name, env in envs.items()}
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (until(reports) if until else all(not p.alive() for p in procs.values())):
            if time.monotonic() > deadline:
                pytest.fail(f"the example did not finish within {RUN_TIMEOUT_S}s\n{processes.logs()}")
            await asyncio.sleep(0.05)
        return procs, reports
    finally:
        receiver.close()


def run_standalone(processes: Processes, root: Path, name: str, argv: list[str],
                   env: dict[str, str] | None = None,
                   on_message: Callable[[ProgressMessage], None] | None = None,
                   until: Callable[[list[ProgressMessage]], bool] | None = None) -> Run:
    """One process run by hand (no cluster), reporting to root/progress.sock; its --output is root/name."""
    output = root / name
    env = FAST_START_ENV | {"TRAINERD_PROGRESS_SOCKET": str(root / "progress.sock")} | (env or {})
    procs, reports = asyncio.run(run_example(processes, root, {name: env}, argv + ["--output", str(output)],
                                             until=until, on_message=on_message))
    return Run(procs, reports, output, processes.logs())
