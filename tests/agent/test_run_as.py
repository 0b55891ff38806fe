"""Training processes as an unprivileged user (`run_as`), with a real user made for the test: they run
with its uid and groups only, write their logs and the job's working directory, report progress, and
the agent changes nothing in that directory with more rights than they have."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import sys
import time
from pathlib import Path

import pytest

from agent.commands import Launch, ProcessSpec, RequestExit
from agent.launcher import SubprocessLauncher
from agent.progress_receiver import open_progress_receiver
from agent.stack_dump import PySpyDumper
from agent.supervisor import Supervisor
from agent.worker_user import WorkerUser
from common.clock import SystemClock
from proto import trainerd_pb2 as pb
from proto.progress_datagram import StepReport, encode
from tests.agent.conftest import WORKER_HOME
from tests.agent.supervisor_fakes import Host, launch, run

# An interpreter the test user may run: the agent's own lives under /root here, which only root may enter.
SYSTEM_PYTHON = "/usr/bin/python3"


def ids(pid: int) -> dict[str, list[int]]:
    """The Uid, Gid (real, effective, saved, filesystem) and Groups lines of /proc/PID/status."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: [int(v) for v in value.split()] for key, _, value in (line.partition(":\t") for line in lines)
            if key in ("Uid", "Gid", "Groups")}


def owner(path: Path) -> tuple[int, int]:
    info = path.lstat()
    return info.st_uid, info.st_gid


async def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def test_the_launcher_starts_a_process_as_the_user_with_its_groups_only_and_it_owns_its_log(
        shared_dir: Path, worker_user: WorkerUser) -> None:
    log_path = shared_dir / "rank0.log"

    async def scenario() -> dict[str, list[int]]:
        handle = await SubprocessLauncher(worker_user).start(
            ["/bin/sh", "-c", 'echo "$HOME $USER $LOGNAME"; id -u; exec sleep 30'], {"HOME": "/root"}, shared_dir,
            log_path)
        try:
            await wait_for(lambda: log_path.read_text().count("\n") == 2, "the process's two lines")
            return ids(handle.pid)
        finally:
            handle.signal_group(signal.SIGKILL)
            await handle.wait()

    status = run(scenario())
    assert status["Uid"] == [worker_user.uid] * 4
    assert status["Gid"] == [worker_user.gid] * 4
    assert sorted(status["Groups"]) == sorted(worker_user.groups) and 0 not in status["Groups"]  # none of root's
    name = worker_user.name
    assert log_path.read_text() == f"{WORKER_HOME} {name} {name}\n{worker_user.uid}\n"
    assert owner(log_path) == (worker_user.uid, worker_user.gid)


# Runs as the worker: reports its uid, writes a file in its working directory, sends the datagram
# given in hex (made by the test: this interpreter need not import trainerd), then waits to be stopped.
WORKER = ("import os, socket, sys, time\n"
          "print('uid', os.getuid(), flush=True)\n"
          "with open('written-by-the-worker', 'w') as f:\n"
          "    f.write('ok')\n"
          "with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:\n"
          "    s.sendto(bytes.fromhex(sys.argv[1]), os.environ['TRAINERD_PROGRESS_SOCKET'])\n"
          "time.sleep(60)\n")


def test_an_agent_with_run_as_runs_its_workers_as_that_user_from_launch_to_graceful_exit(
        shared_dir: Path, worker_user: WorkerUser) -> None:
    work_dir = shared_dir / "agent"
    report = encode(StepReport("job", 1, 0, 7, loss=1.0, grad_norm=0.5, samples_per_s=8.0, consumed_samples=0))
    user = (worker_user.uid, worker_user.gid)

    async def scenario() -> None:
        supervisor = Supervisor(work_dir=work_dir, progress_socket=work_dir / "progress.sock", report=lambda m: None,
                                launcher=SubprocessLauncher(worker_user), stack_dumper=PySpyDumper(),
                                clock=SystemClock(), allowed_entrypoints=[["{python}"]], worker_user=worker_user,
                                python=SYSTEM_PYTHON)
        work_dir.mkdir()
        receiver = await open_progress_receiver(supervisor.progress_socket, supervisor.on_progress,
                                                group=worker_user.gid)
        try:
            socket_info = supervisor.progress_socket.stat()
            assert (stat.S_IMODE(socket_info.st_mode), socket_info.st_gid) == (0o660, worker_user.gid)
            await supervisor.launch(Launch(
                generation=1, job_name="job", rank_table_json="{}", graceful_exit_file="control/exit.json",
                processes=(ProcessSpec(role="worker", rank=0, argv=("{python}", "-c", WORKER, report.hex())),)))
            rank0 = supervisor.processes[("worker", 0)]
            assert rank0.running, rank0.log_path.read_text()
            await wait_for(lambda: rank0.step == 7, "the worker's report through the group-writable socket")
            assert ids(rank0.pid)["Uid"] == [worker_user.uid] * 4
            assert supervisor.foreign_progress == 0

            workdir = work_dir / "jobs" / "job"  # the default one, made by the agent and given to the user
            assert owner(workdir) == user
            assert owner(workdir / "written-by-the-worker") == user
            assert rank0.log_path.read_text() == f"uid {worker_user.uid}\n"
            assert owner(rank0.log_path) == user
            assert owner(rank0.log_path.parent) == (0, 0)  # the generation's files stay the agent's

            await supervisor.request_exit(RequestExit(generation=1))
            exit_file = workdir / "control" / "exit.json"
            assert exit_file.read_bytes() == b'{"GracefulExit": 1}'
            assert owner(exit_file) == owner(exit_file.parent) == user  # written as the user, not as root
        finally:
            await supervisor.shutdown(grace_s=5)
            receiver.close()

    run(scenario())


def test_a_named_workdir_is_made_as_the_user_and_only_where_the_user_may(
        tmp_path: Path, shared_dir: Path, worker_user: WorkerUser) -> None:
    users_own, roots_own = shared_dir / "users", shared_dir / "roots"
    users_own.mkdir()
    os.chown(users_own, worker_user.uid, worker_user.gid)
    roots_own.mkdir()

    async def scenario() -> Host:
        host = Host(tmp_path, worker_user=worker_user)
        await host.supervisor.launch(launch(1, workdir=str(users_own / "job" / "run")))
        assert sorted(host.launcher.started) == ["rank0", "rank1", "scheduler"]
        await host.supervisor.launch(launch(2, workdir=str(roots_own / "job")))
        return host

    host = run(scenario())
    assert owner(users_own / "job") == owner(users_own / "job" / "run") == (worker_user.uid, worker_user.gid)
    assert not (roots_own / "job").exists()
    refused = [e for e in host.sent("process_exited") if e.generation == 2]
    assert [(e.role, e.rank, e.exit_code) for e in refused] == [("scheduler", -1, 127), ("worker", 0, 127),
                                                                 ("worker", 1, 127)]
    assert refused[0].log_tail == (f"cannot prepare the working directory: /bin/mkdir: cannot create directory "
                                   f"'{roots_own / 'job'}': Permission denied")


def test_an_interpreter_the_user_may_not_run_is_reported_with_who_and_what_they_lack(
        shared_dir: Path, worker_user: WorkerUser) -> None:
    """The agent's own interpreter here lies under /root, which the test user may not enter: what an operator
    who set run_as on a host like this one sees in status."""
    work_dir = shared_dir / "agent"
    exits: list[pb.ProcessExited] = []

    async def scenario() -> None:
        supervisor = Supervisor(work_dir=work_dir, progress_socket=work_dir / "progress.sock",
                                report=lambda m: exits.append(m.process_exited) if m.HasField("process_exited")
                                else None, launcher=SubprocessLauncher(worker_user), stack_dumper=PySpyDumper(),
                                clock=SystemClock(), allowed_entrypoints=[["{python}"]], worker_user=worker_user,
                                python=sys.executable)
        work_dir.mkdir()
        try:
            await supervisor.launch(Launch(generation=1, job_name="job", rank_table_json="{}", processes=(
                ProcessSpec(role="worker", rank=0, argv=("{python}", "-c", "pass")),)))
        finally:
            await supervisor.shutdown(grace_s=5)

    assert os.path.realpath(sys.executable).startswith("/root/"), sys.executable
    run(scenario())
    [exited] = exits
    assert exited.exit_code == 127 and exited.log_tail == (
        f"cannot start {sys.executable!r} as user {worker_user.name}: Permission denied (run_as: {worker_user.name} "
        f"needs read and execute on it, on the directories above it and on the training code)")
