"""The supervisor's decisions with a fake launcher and a fake clock (tests/agent/supervisor_fakes.py):
launching, stopping, exits, checkpoint requests and progress throttling."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from pathlib import Path

from agent.commands import CheckpointNow, Stop
from agent.supervisor import PROGRESS_FORWARD_INTERVAL_S
from proto import trainerd_pb2 as pb
from proto.progress_datagram import EventReport, StartupTimes, StepReport, WorkerEvent
from tests.agent.supervisor_fakes import FIRST_FAKE_PID, PYTHON, START, Host, SignalSent, launch, run


def step(generation: int, rank: int, number: int) -> StepReport:
    return StepReport("job", generation, rank, number, loss=1.0, grad_norm=0.5, samples_per_s=10.0,
                      consumed_samples=8 * number)


def test_launch_starts_every_process_with_the_agent_python_and_the_generation_files(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        assert sorted(host.launcher.started) == ["rank0", "rank1", "scheduler"]
        rank1 = host.launcher.started["rank1"]
        assert rank1.argv == [PYTHON, "train.py"]
        assert rank1.env["RANK_ID"] == "1"
        assert rank1.env["PYTHONFAULTHANDLER"] == "1"  # a crash in native code prints its Python line
        assert rank1.env["TRAINERD_PROGRESS_SOCKET"] == str(tmp_path / "progress.sock")
        assert Path(rank1.env["RANK_TABLE_FILE"]).read_text() == "{}"
        assert [(s.role, s.rank, s.pid) for s in host.sent("process_started")] == [
            ("scheduler", -1, FIRST_FAKE_PID), ("worker", 0, FIRST_FAKE_PID + 1), ("worker", 1, FIRST_FAKE_PID + 2)]

    run(scenario())


def test_a_job_that_sets_the_fault_handler_variable_itself_keeps_its_value(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1, env={"PYTHONFAULTHANDLER": ""}))  # off: the job's own choice
        assert host.launcher.started["rank0"].env["PYTHONFAULTHANDLER"] == ""

    run(scenario())


def test_stop_terms_every_group_and_kills_those_still_running_after_the_grace(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        stubborn = host.launcher.started["rank1"]
        stubborn.obeys_sigterm = False
        await host.supervisor.stop(Stop(generation=1, grace_s=5.0, reason="test"))

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

        await host.supervisor.stop(Stop(generation=1, grace_s=5.0))
        await host.supervisor.stop(Stop(generation=3, grace_s=5.0))
        host.supervisor.checkpoint_now(CheckpointNow(generation=1, step=50))
        assert all(p.signals == [] for p in host.launcher.started.values())
        assert host.sent("stopped") == []
        assert not control.exists()

        host.supervisor.checkpoint_now(CheckpointNow(generation=2, step=50))
        assert json.loads(control.read_text())["checkpoint_at_step"] == 50
        await host.supervisor.stop(Stop(generation=2, grace_s=5.0))
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


def test_a_heartbeat_taken_while_the_launch_starts_its_processes_tells_no_worker_as_finished(tmp_path: Path) -> None:
    """A launch awaits each start in turn (a warm worker's hand-over takes milliseconds); a heartbeat in
    between must not report the workers not yet started, least of all as exited with code 0, which the
    coordinator takes for a rank that finished (CI saw a crash-looping job end COMPLETED that way)."""
    async def scenario() -> None:
        host = Host(tmp_path)
        gate = asyncio.Event()
        start = host.launcher.start

        async def slow_start(argv, env, cwd, log_path):
            if log_path.stem == "rank0":
                await gate.wait()
            return await start(argv, env, cwd, log_path)

        host.launcher.start = slow_start  # type: ignore[method-assign]
        launching = asyncio.create_task(host.supervisor.launch(launch(1)))
        while "scheduler" not in host.launcher.started:
            await asyncio.sleep(0)
        reported = {(p.role, p.rank): p.state for p in host.supervisor.heartbeat().processes}
        assert reported == {("scheduler", -1): pb.PROCESS_RUNNING}
        gate.set()
        await launching
        assert len(host.supervisor.heartbeat().processes) == 3

    run(scenario())


def test_an_entrypoint_that_cannot_be_executed_is_reported_as_exit_127(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path, allowed_entrypoints=[["/no/such/train"]])
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

        host.progress(step(1, 0, 1))  # the first goes at once
        host.clock.advance(0.125)  # binary fractions: the sums below are exact
        host.progress(step(1, 1, 1))  # another rank has its own interval
        host.progress(step(1, 0, 2))
        host.clock.advance(0.25)
        host.progress(step(1, 0, 3))
        assert forwarded() == [(0, 1), (1, 1)]
        host.clock.advance(PROGRESS_FORWARD_INTERVAL_S - 0.375)
        host.progress(step(1, 0, 4))  # the newest step replaces those held back
        assert forwarded() == [(0, 1), (1, 1), (0, 4)]
        host.progress(step(1, 0, 5))
        host.progress(step(0, 0, 99))  # from another generation: dropped
        heartbeat = supervisor.heartbeat()  # a heartbeat sends what was held back
        assert forwarded() == [(0, 1), (1, 1), (0, 4), (0, 5)]
        assert {(p.rank, p.step) for p in heartbeat.processes if p.role == "worker"} == {(0, 5), (1, 1)}

    run(scenario())


def test_a_forwarded_step_carries_every_field_the_worker_reported(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        host.progress(StepReport("job", 1, 0, 7, loss=2.5, grad_norm=0.75, samples_per_s=96.0, consumed_samples=56,
                                 checkpoint_stall_s=1.25))
        [sent] = host.sent("progress")
        assert (sent.step, sent.loss, sent.grad_norm, sent.samples_per_s, sent.consumed_samples,
                sent.checkpoint_stall_s) == (7, 2.5, 0.75, 96.0, 56, 1.25)

    run(scenario())


def test_a_ranks_start_up_times_reach_the_coordinator_even_when_a_newer_step_replaces_the_report_held(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        host.progress(step(1, 0, 1))  # sent at once: a rank's first
        host.progress(StepReport("job", 1, 1, 1, loss=1.0, grad_norm=0.5, samples_per_s=10.0, consumed_samples=8,
                                 startup=StartupTimes(1.5, 0.25, 0.75)))
        host.progress(step(1, 0, 2))
        host.progress(StepReport("job", 1, 0, 3, loss=1.0, grad_norm=0.5, samples_per_s=10.0, consumed_samples=24,
                                 startup=StartupTimes(2.0, 0.5, 1.0)))  # held back behind step 1
        host.progress(step(1, 0, 4))  # replaces step 3 in the hold: its start-up times stay
        host.supervisor.heartbeat()
        told = {(p.rank, p.step): p.startup for p in host.sent("progress") if p.HasField("startup")}
        assert told == {(1, 1): pb.RankStartup(comm_setup_s=1.5, load_s=0.25, first_step_s=0.75),
                        (0, 4): pb.RankStartup(comm_setup_s=2.0, load_s=0.5, first_step_s=1.0)}

    run(scenario())


def test_a_rank_that_evaluates_or_ends_its_training_sends_its_last_step_again_marked_so(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        evaluating = EventReport("job", 1, 0, WorkerEvent.EVALUATING, 7)
        host.progress(evaluating)  # before the rank's first step: nothing to repeat
        assert host.sent("progress") == []
        host.progress(StepReport("job", 1, 0, 7, loss=2.5, grad_norm=0.75, samples_per_s=96.0, consumed_samples=56))
        host.clock.advance(PROGRESS_FORWARD_INTERVAL_S)
        host.progress(evaluating)
        first, again = host.sent("progress")
        assert not first.evaluating and again.evaluating
        assert (again.step, again.loss, again.consumed_samples) == (first.step, first.loss, first.consumed_samples)
        host.progress(EventReport("job", 1, 0, WorkerEvent.FINISHED, 7))  # within the interval: sent at once
        finished = host.sent("progress")[-1]
        assert finished.training_finished and not finished.evaluating and finished.step == 7

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


def test_the_log_gives_a_killed_process_no_cause_from_the_line_it_was_cut_off_at(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, "agent")

    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        host.launcher.started["rank0"].exit(-signal.SIGKILL, "epoch: 40 step: 14, loss is 0.0188\n")
        await host.exited("rank0")
        host.launcher.started["rank1"].exit(1, "Traceback (most recent call last):\n  File \"t.py\", line 3\n"
                                               "RuntimeError: boom\n")
        await host.exited("rank1")

    run(scenario())
    started = [r.getMessage() for r in caplog.records if " started (pid " in r.getMessage()]
    assert started == [f"the scheduler of generation 1 started (pid {FIRST_FAKE_PID})",  # how a user finds a pid
                       f"worker 0 of generation 1 started (pid {FIRST_FAKE_PID + 1})",
                       f"worker 1 of generation 1 started (pid {FIRST_FAKE_PID + 2})"]
    exits = [r.getMessage() for r in caplog.records if "exited: code" in r.getMessage()]
    assert exits[0] == f"worker 0 of generation 1 (pid {FIRST_FAKE_PID + 1}) exited: code 0 signal 9", exits
    assert exits[1].endswith("exited: code 1 signal 0; cause: RuntimeError: boom at t.py:3"), exits
