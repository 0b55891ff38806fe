"""The supervisor's decisions with a fake launcher and a fake clock: no processes, no sleeps.

The fake processes exit when a test says so, or on the signals a real one would obey; every signal
is recorded with the clock's time and whether the process was still running when it came.
"""

from __future__ import annotations

import asyncio
import errno
import json
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.supervisor import PROGRESS_FORWARD_INTERVAL_S, Supervisor
from common.clock import FakeClock
from proto import trainerd_pb2 as pb
from proto.progress_datagram import StepReport

PYTHON = "/opt/agent/bin/python"
START = 100.0
# Above any Linux pid_max, so the process registry never mistakes a fake pid for a real process.
FIRST_FAKE_PID = 10_000_000


@dataclass(frozen=True)
class SignalSent:
    signum: int
    at: float
    while_running: bool


class FakeProcess:
    def __init__(self, pid: int, argv: Sequence[str], env: Mapping[str, str], log_path: Path, clock: FakeClock):
        self.pid = pid
        self.argv = list(argv)
        self.env = dict(env)
        self.log_path = log_path
        self.obeys_sigterm = True
        self.signals: list[SignalSent] = []
        self._clock = clock
        self._returncode: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def wait(self) -> int:
        return await asyncio.shield(self._returncode)

    def signal_group(self, signum: int) -> None:
        self.signals.append(SignalSent(signum, self._clock.now(), not self._returncode.done()))
        if signum == signal.SIGKILL or (signum == signal.SIGTERM and self.obeys_sigterm):
            self.exit(-signum)

    def exit(self, returncode: int, output: str = "") -> None:
        if output:
            with open(self.log_path, "a") as log_file:
                log_file.write(output)
        if not self._returncode.done():
            self._returncode.set_result(returncode)

    def signums(self, while_running: bool | None = None) -> list[int]:
        return [s.signum for s in self.signals if while_running is None or s.while_running == while_running]


class FakeLauncher:
    """Starts FakeProcesses, named by their log file ("rank0", "scheduler"); `cannot_execute` fails."""

    def __init__(self, clock: FakeClock) -> None:
        self._clock = clock
        self.started: dict[str, FakeProcess] = {}
        self.cannot_execute: set[str] = set()

    async def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path) -> FakeProcess:
        if argv[0] in self.cannot_execute:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", argv[0])
        log_path.touch()
        process = FakeProcess(FIRST_FAKE_PID + len(self.started), argv, env, log_path, self._clock)
        self.started[log_path.stem] = process
        return process


class Host:
    """One supervisor with its fakes and every report it sent."""

    def __init__(self, work_dir: Path) -> None:
        self.clock = FakeClock(start=START)
        self.launcher = FakeLauncher(self.clock)
        self.reports: list[pb.AgentMessage] = []
        self.supervisor = Supervisor(work_dir=work_dir, progress_socket=work_dir / "progress.sock",
                                     report=self.reports.append, launcher=self.launcher, clock=self.clock,
                                     python=PYTHON)

    def sent(self, kind: str) -> list:
        return [getattr(m, kind) for m in self.reports if m.WhichOneof("body") == kind]

    async def exited(self, name: str) -> None:
        """Waits until the supervisor has handled the exit of process `name`."""
        role, rank = ("scheduler", -1) if name == "scheduler" else ("worker", int(name.removeprefix("rank")))
        waiter = self.supervisor.processes[(role, rank)].waiter
        assert waiter is not None
        await waiter


def launch(generation: int, workers: int = 2, entrypoint: str = "{python}") -> pb.Launch:
    processes = [pb.ProcessSpec(role="scheduler", rank=-1, argv=[entrypoint, "train.py"])]
    processes += [pb.ProcessSpec(role="worker", rank=r, argv=[entrypoint, "train.py"], env={"RANK_ID": str(r)})
                  for r in range(workers)]
    return pb.Launch(generation=generation, job_name="job", processes=processes, rank_table_json="{}")


def step(generation: int, rank: int, number: int) -> StepReport:
    return StepReport("job", generation, rank, number, loss=1.0, grad_norm=0.5, samples_per_s=10.0,
                      consumed_samples=8 * number)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_launch_starts_every_process_with_the_agent_python_and_the_generation_files(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        assert sorted(host.launcher.started) == ["rank0", "rank1", "scheduler"]
        rank1 = host.launcher.started["rank1"]
        assert rank1.argv == [PYTHON, "train.py"]
        assert rank1.env["RANK_ID"] == "1"
        assert rank1.env["TRAINERD_PROGRESS_SOCKET"] == str(tmp_path / "progress.sock")
        assert Path(rank1.env["RANK_TABLE_FILE"]).read_text() == "{}"
        assert [(s.role, s.rank, s.pid) for s in host.sent("process_started")] == [
            ("scheduler", -1, FIRST_FAKE_PID), ("worker", 0, FIRST_FAKE_PID + 1), ("worker", 1, FIRST_FAKE_PID + 2)]

    run(scenario())


def test_stop_terms_every_group_and_kills_those_still_running_after_the_grace(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        stubborn = host.launcher.started["rank1"]
        stubborn.obeys_sigterm = False
        await host.supervisor.stop(pb.Stop(generation=1, grace_s=5.0, reason="test"))

        for name, process in host.launcher.started.items():
            assert process.signals[0] == SignalSent(signal.SIGTERM, START, True), name
        assert stubborn.signums(while_running=True) == [signal.SIGTERM, signal.SIGKILL]
        assert stubborn.signals[1].at == START + 5.0  # not before the grace was over
        for name in ("scheduler", "rank0"):  # they obeyed SIGTERM: no SIGKILL while they ran
            assert host.launcher.started[name].signums(while_running=True) == [signal.SIGTERM], name
            assert signal.SIGKILL in host.launcher.started[name].signums(while_running=False), name
        exits = {(e.role, e.rank): (e.signal, e.expected) for e in host.sent("process_exited")}
        assert exits == {("scheduler", -1): (signal.SIGTERM, True), ("worker", 0): (signal.SIGTERM, True),
                         ("worker", 1): (signal.SIGKILL, True)}
        assert host.reports[-1].WhichOneof("body") == "stopped"
        assert host.reports[-1].stopped.generation == 1

    run(scenario())


def test_stop_and_checkpoint_now_for_another_generation_are_ignored(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(2))
        control = Path(host.launcher.started["rank0"].env["TRAINERD_CONTROL_FILE"])

        await host.supervisor.stop(pb.Stop(generation=1, grace_s=5.0))
        await host.supervisor.stop(pb.Stop(generation=3, grace_s=5.0))
        host.supervisor.checkpoint_now(pb.CheckpointNow(generation=1, step=50))
        assert all(p.signals == [] for p in host.launcher.started.values())
        assert host.sent("stopped") == []
        assert not control.exists()

        host.supervisor.checkpoint_now(pb.CheckpointNow(generation=2, step=50))
        assert json.loads(control.read_text())["checkpoint_at_step"] == 50
        await host.supervisor.stop(pb.Stop(generation=2, grace_s=5.0))
        assert [s.generation for s in host.sent("stopped")] == [2]

    run(scenario())


def test_a_launch_of_an_older_or_equal_generation_is_ignored(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(2))
        first = dict(host.launcher.started)
        await host.supervisor.launch(launch(2))
        await host.supervisor.launch(launch(1))
        assert host.launcher.started == first
        assert all(p.signals == [] for p in first.values())
        assert host.supervisor.generation == 2

        await host.supervisor.launch(launch(3))  # a newer one replaces generation 2's processes
        assert host.supervisor.generation == 3
        assert all(p.signums()[:1] == [signal.SIGTERM] for p in first.values())
        assert all(host.launcher.started[name] is not first[name] for name in first)

    run(scenario())


def test_an_exit_is_reported_with_its_code_signal_and_log_tail(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        crashed = host.launcher.started["rank0"]
        crashed.exit(1, "step 7\nTraceback (most recent call last):\nRuntimeError: boom\n")
        await host.exited("rank0")
        host.launcher.started["rank1"].exit(-signal.SIGSEGV)
        await host.exited("rank1")

        first, second = host.sent("process_exited")
        assert (first.generation, first.role, first.rank, first.pid) == (1, "worker", 0, crashed.pid)
        assert (first.exit_code, first.signal, first.expected) == (1, 0, False)
        assert first.log_tail.endswith("RuntimeError: boom\n")
        assert (second.rank, second.exit_code, second.signal) == (1, 0, signal.SIGSEGV)
        assert crashed.signals == [SignalSent(signal.SIGKILL, START, False)]  # what it left in its group
        states = {(p.role, p.rank): p.state for p in host.supervisor.heartbeat().processes}
        assert states == {("scheduler", -1): pb.PROCESS_RUNNING, ("worker", 0): pb.PROCESS_EXITED,
                          ("worker", 1): pb.PROCESS_EXITED}

    run(scenario())


def test_an_entrypoint_that_cannot_be_executed_is_reported_as_exit_127(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        host.launcher.cannot_execute.add("/no/such/train")
        await host.supervisor.launch(launch(1, workers=1, entrypoint="/no/such/train"))
        assert host.launcher.started == {}
        assert host.sent("process_started") == []
        exits = host.sent("process_exited")
        assert [(e.role, e.rank, e.exit_code) for e in exits] == [("scheduler", -1, 127), ("worker", 0, 127)]
        message = "cannot start '/no/such/train': No such file or directory"
        assert exits[1].log_tail == message
        log_file = tmp_path / "generations" / "000001" / "rank0.log"
        assert log_file.read_text() == message + "\n"
        assert [p.exit_code for p in host.supervisor.heartbeat().processes] == [127, 127]

    run(scenario())


def test_progress_is_forwarded_at_most_every_half_second_per_rank(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        supervisor = host.supervisor
        await supervisor.launch(launch(1))

        def forwarded() -> list[tuple[int, int]]:
            return [(p.rank, p.step) for p in host.sent("progress")]

        supervisor.on_progress(step(1, 0, 1))  # the first goes at once
        host.clock.advance(0.125)  # binary fractions: the sums below are exact
        supervisor.on_progress(step(1, 1, 1))  # another rank has its own interval
        supervisor.on_progress(step(1, 0, 2))
        host.clock.advance(0.25)
        supervisor.on_progress(step(1, 0, 3))
        assert forwarded() == [(0, 1), (1, 1)]
        host.clock.advance(PROGRESS_FORWARD_INTERVAL_S - 0.375)
        supervisor.on_progress(step(1, 0, 4))  # the newest step replaces those held back
        assert forwarded() == [(0, 1), (1, 1), (0, 4)]
        supervisor.on_progress(step(1, 0, 5))
        supervisor.on_progress(step(0, 0, 99))  # from another generation: dropped
        heartbeat = supervisor.heartbeat()  # a heartbeat sends what was held back
        assert forwarded() == [(0, 1), (1, 1), (0, 4), (0, 5)]
        assert {(p.rank, p.step) for p in heartbeat.processes if p.role == "worker"} == {(0, 5), (1, 1)}

    run(scenario())


def test_the_heartbeat_is_stamped_with_the_clock_wall_time(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(4, workers=1))
        host.clock.advance(12.5)
        heartbeat = host.supervisor.heartbeat()
        assert heartbeat.sent_at == host.clock.wall()
        assert heartbeat.generation == 4
        assert sorted((p.role, p.rank, p.pid, p.state) for p in heartbeat.processes) == [
            ("scheduler", -1, FIRST_FAKE_PID, pb.PROCESS_RUNNING),
            ("worker", 0, FIRST_FAKE_PID + 1, pb.PROCESS_RUNNING)]

    run(scenario())
