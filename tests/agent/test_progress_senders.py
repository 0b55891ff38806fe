"""Only a rank's own process, or one it started, may report progress for it: any process on the host
can write to the socket, so the kernel's word on each sender (SCM_CREDENTIALS) decides.

First with real processes, a real socket and the real supervisor and launcher; then the counting and
the rate-limited warning with the fakes."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path

import pytest

from agent.commands import Launch, ProcessSpec
from agent.launcher import SubprocessLauncher
from agent.progress_receiver import open_progress_receiver
from agent.stack_dump import PySpyDumper
from agent.supervisor import FOREIGN_PROGRESS_WARNING_INTERVAL_S, Supervisor
from common.clock import SystemClock
from proto import trainerd_pb2 as pb
from proto.progress_datagram import StepReport
from tests.agent.supervisor_fakes import Host, launch, run

SEND = ("import socket\n"
        "from proto.progress_datagram import StepReport, encode\n"
        "def send(path, step):\n"
        "    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:\n"
        "        s.sendto(encode(StepReport('job', 1, 0, step, 1.0, 0.5, 8.0, 0)), path)\n")
# `python -c REPORT SOCKET STEP`: one report of STEP for rank 0 of generation 1.
REPORT = SEND + "import sys\nsend(sys.argv[1], int(sys.argv[2]))\n"
# Rank 0 reports step 1 itself, then step 2 from a child it starts, then waits to be stopped.
WORKER = SEND + ("import os, subprocess, sys, time\n"
                 "path = os.environ['TRAINERD_PROGRESS_SOCKET']\n"
                 "send(path, 1)\n"
                 f"subprocess.run([sys.executable, '-c', {REPORT!r}, path, '2'], check=True)\n"
                 "time.sleep(60)\n")


async def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def test_reports_from_the_rank_and_its_child_are_taken_and_from_another_process_dropped(tmp_path: Path) -> None:
    async def scenario() -> list[int]:
        reports: list[pb.AgentMessage] = []
        supervisor = Supervisor(work_dir=tmp_path, progress_socket=tmp_path / "progress.sock", report=reports.append,
                                launcher=SubprocessLauncher(), stack_dumper=PySpyDumper(), clock=SystemClock(),
                                allowed_entrypoints=[["{python}"]])
        receiver = await open_progress_receiver(supervisor.progress_socket, supervisor.on_progress)
        try:
            await supervisor.launch(Launch(generation=1, job_name="job", rank_table_json="{}", processes=(
                ProcessSpec(role="worker", rank=0, argv=("{python}", "-c", WORKER)),)))
            rank0 = supervisor.processes[("worker", 0)]
            await wait_for(lambda: rank0.step == 2, "steps 1 and 2 from rank 0 and its child")
            stranger = await asyncio.create_subprocess_exec(sys.executable, "-c", REPORT,
                                                            str(supervisor.progress_socket), "99")
            assert await stranger.wait() == 0
            await wait_for(lambda: receiver.received == 3, "the stranger's report")
            assert supervisor.foreign_progress == 1
            assert rank0.step == 2 and rank0.running
            supervisor.heartbeat()  # sends what the throttle held back
            return [m.progress.step for m in reports if m.WhichOneof("body") == "progress"]
        finally:
            await supervisor.shutdown(grace_s=5)
            receiver.close()

    assert run(scenario()) == [1, 2]


def step(rank: int, number: int) -> StepReport:
    return StepReport("job", 1, rank, number, loss=1.0, grad_norm=0.5, samples_per_s=10.0, consumed_samples=0)


def test_foreign_reports_are_counted_and_warned_about_once_a_minute(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> Host:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        rank1 = host.launcher.started["rank1"].pid
        with caplog.at_level(logging.WARNING, logger="agent.supervisor"):
            for number in (1, 2, 3):
                host.supervisor.on_progress(step(0, number), rank1)  # rank 1's process speaking for rank 0
            host.clock.advance(FOREIGN_PROGRESS_WARNING_INTERVAL_S)
            host.supervisor.on_progress(step(0, 4), 0)  # no credentials at all
            host.supervisor.on_progress(step(1, 5), rank1)  # its own rank: taken
        return host

    host = run(scenario())
    rank0, rank1 = host.launcher.started["rank0"].pid, host.launcher.started["rank1"].pid
    assert host.supervisor.foreign_progress == 4
    assert [(p.rank, p.step) for p in host.sent("progress")] == [(1, 5)]
    assert host.supervisor.processes[("worker", 0)].step == 0
    prefix = "generation 1 of job job: dropped"
    middle = "progress datagram(s) not sent by the process of their rank nor one it started"
    assert [r.getMessage() for r in caplog.records] == [
        f"{prefix} 1 {middle} (1 in all); the last, for rank 0 (pid {rank0}), came from pid {rank1}",
        f"{prefix} 3 {middle} (4 in all); the last, for rank 0 (pid {rank0}), came from pid 0",
    ]
