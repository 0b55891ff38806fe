"""The supervisor running an unmodified msrun-style script (issue 11), with the fakes of
tests/agent/supervisor_fakes.py: its working directory, progress read from its output, the root
cause of its failure, its stacks before a hang kill and its graceful exit."""

from __future__ import annotations

import asyncio
import json
import math
import signal
from dataclasses import replace
from pathlib import Path

import pytest

from agent.commands import RequestExit, Stop
from agent.supervisor import OUTPUT_POLL_INTERVAL_S, STACK_DUMP_TIMEOUT_S
from proto import trainerd_pb2 as pb
from proto.progress_datagram import StepReport
from tests.agent.supervisor_fakes import START, Host, launch, run

SAMPLES = Path(__file__).parents[1] / "integration" / "jobs" / "output_samples"
# Where the script was when the samples were recorded; the tests put it in their own workdir.
SAMPLE_SCRIPT_DIR = "/work/wt/jobs/tests/integration/jobs"


def progress_of(host: Host, rank: int) -> list[tuple]:
    """(step, epoch or None, loss, from_output) of every Progress sent for `rank`."""
    return [(p.step, p.epoch if p.HasField("epoch") else None, p.loss, p.from_output)
            for p in host.sent("progress") if p.rank == rank]


def heartbeat_steps(host: Host) -> dict[int, int]:
    return {p.rank: p.step for p in host.supervisor.heartbeat().processes if p.role == "worker"}


def exit_of(host: Host, rank: int) -> pb.ProcessExited:
    (exited,) = [e for e in host.sent("process_exited") if e.rank == rank]
    return exited


# ---------------------------------------------------------------- working directory


def test_processes_run_in_the_jobs_own_directory_the_same_for_every_generation(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        workdir = tmp_path / "jobs" / "job"
        assert workdir.is_dir()
        assert {p.cwd for p in host.launcher.started.values()} == {workdir}
        (workdir / "ckpt").mkdir()  # what the first generation's script left behind

        await host.supervisor.launch(launch(2))
        rank0 = host.launcher.started["rank0"]
        assert rank0.cwd == workdir and rank0.cwd_at_start == ["ckpt"]
        generation_dir = tmp_path / "generations" / "000002"
        assert rank0.log_path == generation_dir / "rank0.log"
        assert Path(rank0.env["RANK_TABLE_FILE"]).parent == generation_dir
        assert Path(rank0.env["TRAINERD_SKIPS_FILE"]).parent == generation_dir

    run(scenario())


def test_processes_run_in_the_workdir_the_launch_names_created_when_missing(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        workdir = tmp_path / "shared" / "mnist"
        await host.supervisor.launch(launch(1, workdir=str(workdir)))
        assert workdir.is_dir()
        assert {p.cwd for p in host.launcher.started.values()} == {workdir}
        assert not (tmp_path / "jobs").exists()

    run(scenario())


@pytest.mark.parametrize("field, value, reason", [
    ("job_name", "..", "job name '..' is not a plain directory name"),
    ("job_name", "a/../../etc", "job name 'a/../../etc' is not a plain directory name"),
    ("workdir", "/", "workdir '/' is the root directory"),
    ("workdir", "relative/dir", "workdir 'relative/dir' is not an absolute path"),
    ("workdir", "/srv/jobs/../../etc", "workdir '/srv/jobs/../../etc' climbs out with '..'"),
    ("workdir", "/srv/job\n[ERROR] forged line", "holds control characters"),
    ("graceful_exit_file", "../exit.json", "graceful_exit_file '../exit.json' is not a file path inside"),
])
def test_a_launch_whose_paths_would_escape_is_refused_and_reported_as_failed(
        tmp_path: Path, field: str, value: str, reason: str) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(replace(launch(1), **{field: value}))
        assert host.launcher.started == {}
        assert host.sent("process_started") == []
        exits = host.sent("process_exited")
        assert [(e.role, e.rank, e.exit_code) for e in exits] == [("scheduler", -1, 127), ("worker", 0, 127),
                                                                  ("worker", 1, 127)]
        for exited in exits:
            assert exited.log_tail.startswith("refused to launch: ") and reason in exited.log_tail
            assert "\n" not in exited.log_tail
            assert exited.cause.message == exited.log_tail
        log_file = tmp_path / "generations" / "000001" / "rank0.log"
        assert log_file.read_text() == exits[1].log_tail + "\n"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["generations"]  # nothing made elsewhere

    run(scenario())


def test_a_workdir_that_cannot_be_created_fails_the_processes_with_the_reason(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        (tmp_path / "a-file").write_text("")
        await host.supervisor.launch(launch(1, workers=1, workdir=str(tmp_path / "a-file" / "run")))
        assert host.launcher.started == {}
        exits = host.sent("process_exited")
        assert [e.exit_code for e in exits] == [127, 127]
        assert exits[1].log_tail.startswith(f"cannot prepare the working directory {tmp_path / 'a-file'}")

    run(scenario())


# ---------------------------------------------------------------- progress from output


def test_loss_monitor_lines_become_progress_reports_from_the_output(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        rank0 = host.launcher.started["rank0"]
        rank0.write("epoch: 1 step: 1, loss is 0.6931471824645996\nepoch: 1 step: 2, loss is 0.5\n")
        host.supervisor.read_output()
        assert progress_of(host, 0) == [(1, 1, 0.6931471824645996, True)]  # the second is held back
        assert heartbeat_steps(host) == {0: 2, 1: 0}
        assert progress_of(host, 0)[-1] == (2, 1, 0.5, True)  # the heartbeat sent it

        host.clock.advance(OUTPUT_POLL_INTERVAL_S)
        rank0.write("epoch: 1 step: 3, loss is 0.25\nTrain epoch time: 1608.691 ms, per step time: 321.738 ms\n"
                    "epoch: 2 step: 1, loss is ")
        host.supervisor.read_output()
        assert progress_of(host, 0)[-1] == (3, 1, 0.25, True)
        host.clock.advance(OUTPUT_POLL_INTERVAL_S)
        rank0.write("0.125\n")  # the rest of the line
        host.supervisor.read_output()
        assert progress_of(host, 0)[-1] == (4, 2, 0.125, True)  # 3 steps per epoch, learnt at epoch 2
        assert heartbeat_steps(host) == {0: 4, 1: 0}
        assert progress_of(host, 1) == []
        progress = host.sent("progress")[-1]
        assert (progress.generation, progress.samples_per_s, progress.grad_norm) == (1, 0.0, 0.0)

    run(scenario())


def test_a_relaunch_of_the_same_script_counts_its_steps_true_from_its_first_line(tmp_path: Path) -> None:
    """Generation 1 showed 3 steps an epoch; generation 2 resumes at epoch 3 (its own checkpoint): its first
    line is the run's step 8, not step 2 (status would go back, goodput count the epoch as lost work)."""
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1, workers=1))
        host.launcher.started["rank0"].write("".join(f"epoch: {e} step: {s}, loss is 0.5\n"
                                                     for e in (1, 2) for s in (1, 2, 3)))
        host.supervisor.read_output()
        await host.supervisor.stop(Stop(generation=1, grace_s=1.0))
        for generation, script, first in ((2, "train.py", 8), (3, "other.py", 2)):  # another command: unknown
            await host.supervisor.launch(launch(generation, workers=1, script=script))
            host.launcher.started["rank0"].write("epoch: 3 step: 2, loss is 0.5\n")
            host.clock.advance(OUTPUT_POLL_INTERVAL_S)
            host.supervisor.read_output()
            assert progress_of(host, 0)[-1][:2] == (first, 3), generation
            await host.supervisor.stop(Stop(generation=generation, grace_s=1.0))
        restarted = Host(tmp_path)  # the agent started again (local agents do, with trainerd)
        await restarted.supervisor.launch(launch(4, workers=1))
        restarted.launcher.started["rank0"].write("epoch: 3 step: 2, loss is 0.5\n")
        restarted.supervisor.read_output()
        assert progress_of(restarted, 0)[-1][:2] == (8, 3)

    run(scenario())


def test_a_jobs_progress_pattern_is_used_and_an_unknown_loss_is_nan(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        pattern = r"^iter (?P<step>\d+) (?P<samples_per_s>\S+)/s"
        await host.supervisor.launch(launch(1, workers=1, progress_pattern=pattern))
        host.launcher.started["rank0"].write("epoch: 1 step: 9, loss is 0.5\niter 40 512.5/s\n")
        host.supervisor.read_output()
        (progress,) = host.sent("progress")
        assert (progress.step, progress.samples_per_s, progress.from_output) == (40, 512.5, True)
        assert math.isnan(progress.loss)
        assert not progress.HasField("epoch")

    run(scenario())


def test_the_output_is_read_until_the_exit_and_its_last_line_flushed(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        rank1 = host.launcher.started["rank1"]
        resumed = (SAMPLES / "resumed_rank.log").read_text()
        middle = len(resumed) // 2
        rank1.write(resumed[:middle])
        host.supervisor.read_output()
        host.clock.advance(OUTPUT_POLL_INTERVAL_S)
        rank1.exit(0, resumed[middle:] + "epoch: 8 step: 1, loss is 0.03125")  # no newline at the end
        await host.exited("rank1")
        kinds = [m.WhichOneof("body") for m in host.reports if m.WhichOneof("body") in ("progress", "process_exited")]
        assert kinds[-2:] == ["progress", "process_exited"]  # the last step goes out before the exit
        # Resumed at epoch 3, epochs of 10 steps: epoch 8's first step is the run's step 71.
        assert progress_of(host, 1)[-1] == (71, 8, 0.03125, True)
        assert heartbeat_steps(host)[1] == 71

    run(scenario())


def test_the_output_is_polled_on_the_clock(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1, workers=1))
        rank0 = host.launcher.started["rank0"]
        watcher = asyncio.create_task(host.supervisor.watch_output())

        async def reported(step: int) -> None:
            while not any(p.step == step for p in host.sent("progress")):
                await asyncio.sleep(0)

        try:
            for step in (1, 2, 3):
                before = host.clock.now()
                rank0.write(f"epoch: 1 step: {step}, loss is 0.5\n")
                await reported(step)
                assert host.clock.now() - before <= OUTPUT_POLL_INTERVAL_S  # read at the next poll
        finally:
            watcher.cancel()
        assert [p.step for p in host.sent("progress")] == [1, 2, 3]  # polls are 0.5 s apart: none held back

    run(scenario())


def test_a_rank_that_sends_datagrams_is_not_also_reported_from_its_output(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        rank0, rank1 = host.launcher.started["rank0"], host.launcher.started["rank1"]
        rank0.write("epoch: 1 step: 1, loss is 0.5\nepoch: 1 step: 30, loss is 0.4\n")
        rank1.write("epoch: 1 step: 1, loss is 0.5\n")
        host.supervisor.read_output()  # rank 0's step 30 is held back
        host.progress(StepReport("job", 1, 0, 5, loss=0.75, grad_norm=1.0, samples_per_s=64.0, consumed_samples=320))
        assert heartbeat_steps(host) == {0: 5, 1: 1}  # the runtime's step, not the output's
        assert progress_of(host, 0) == [(1, 1, 0.5, True), (5, None, 0.75, False)]  # step 30 was dropped

        host.clock.advance(1.0)
        rank0.write("epoch: 1 step: 31, loss is 0.3\n")
        rank1.write("epoch: 1 step: 2, loss is 0.25\n")
        host.supervisor.read_output()
        rank0.exit(0, "epoch: 1 step: 32, loss is 0.2\n")
        await host.exited("rank0")
        assert progress_of(host, 0) == [(1, 1, 0.5, True), (5, None, 0.75, False)]
        assert progress_of(host, 1) == [(1, 1, 0.5, True), (2, 1, 0.25, True)]
        assert heartbeat_steps(host) == {0: 5, 1: 2}

    run(scenario())


# ---------------------------------------------------------------- root cause


def test_a_failed_process_is_reported_with_the_root_cause_from_its_output(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        workdir = tmp_path / "user-job"
        await host.supervisor.launch(launch(1, workdir=str(workdir)))
        output = (SAMPLES / "raised_mid_run_rank.log").read_text().replace(SAMPLE_SCRIPT_DIR, str(workdir))
        host.launcher.started["rank1"].exit(1, output + "[INFO] later lines\n" * 2000)  # pushed out of log_tail
        await host.exited("rank1")

        exited = exit_of(host, 1)
        assert (exited.exit_code, exited.signal, exited.expected) == (1, 0, False)
        assert (exited.cause.kind, exited.cause.message, exited.cause.location) == (
            "python_exception", "ValueError: bad value at step 7", "msrun_style.py:95")
        assert exited.log_tail.endswith("[INFO] later lines\n") and "ValueError" not in exited.log_tail
        assert progress_of(host, 1)[-1][:2] == (7, 2)

    run(scenario())


def test_a_signal_death_has_a_cause_and_a_stop_or_a_clean_exit_has_none(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        host.launcher.started["rank0"].exit(-signal.SIGSEGV, "epoch: 1 step: 3, loss is 0.5\nFatal Python error: "
                                                             "Segmentation fault\n")
        await host.exited("rank0")
        host.launcher.started["rank1"].exit(0, "Traceback (most recent call last):\nValueError: handled\ndone\n")
        await host.exited("rank1")
        host.launcher.started["scheduler"].write("Traceback (most recent call last):\nRuntimeError: x\n")
        await host.supervisor.stop(Stop(generation=1, grace_s=5.0))

        crashed = exit_of(host, 0)
        assert crashed.signal == signal.SIGSEGV
        assert (crashed.cause.kind, crashed.cause.message) == ("fatal_error", "Fatal Python error: Segmentation fault")
        assert not exit_of(host, 1).HasField("cause")
        assert not exit_of(host, -1).HasField("cause") and exit_of(host, -1).expected

    run(scenario())


# ---------------------------------------------------------------- stacks before a hang kill


def test_a_hang_stop_dumps_every_process_stack_into_its_log_before_sigterm(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        host.launcher.started["rank1"].write("epoch: 1 step: 3, loss is 0.5\n")
        await host.supervisor.stop(Stop(generation=1, grace_s=5.0, reason="hang", dump_stacks=True))

        started = host.launcher.started
        assert sorted(a.pid for a in host.dumper.asked) == sorted(p.pid for p in started.values())
        assert not any(a.signalled_before for a in host.dumper.asked)  # every dump came before any SIGTERM
        assert all(p.signums()[0] == signal.SIGTERM for p in started.values())
        generation_dir = tmp_path / "generations" / "000001"
        rank1 = started["rank1"]
        header = f"==== trainerd: Python stacks of rank 1 (pid {rank1.pid}) before the hang kill ====\n"
        stacks = f"{header}Thread {rank1.pid} (idle)\n    stuck_in_allreduce (train.py:42)\n"
        assert rank1.log_path.read_text() == f"epoch: 1 step: 3, loss is 0.5\n\n{stacks}"
        assert (generation_dir / "rank1.stacks.txt").read_text() == stacks
        scheduler_stacks = (generation_dir / "scheduler.stacks.txt").read_text()
        scheduler_pid = started["scheduler"].pid
        assert scheduler_stacks.startswith(f"==== trainerd: Python stacks of the scheduler (pid {scheduler_pid})")
        assert [s.generation for s in host.sent("stopped")] == [1]

    run(scenario())


def test_a_stack_dump_that_does_not_finish_holds_the_stop_up_for_its_timeout_only(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        rank0 = host.launcher.started["rank0"]
        host.dumper.hangs.add(rank0.pid)
        await host.supervisor.stop(Stop(generation=1, grace_s=5.0, reason="hang", dump_stacks=True))

        assert host.dumper.cancelled == [rank0.pid]
        assert rank0.signals[0].signum == signal.SIGTERM and rank0.signals[0].at == START + STACK_DUMP_TIMEOUT_S
        stacks = (tmp_path / "generations" / "000001" / "rank0.stacks.txt").read_text()
        assert stacks.splitlines()[1:] == [f"the stack dump did not finish within {STACK_DUMP_TIMEOUT_S:.0f}s"]
        assert "stuck_in_allreduce" in (tmp_path / "generations" / "000001" / "rank1.stacks.txt").read_text()
        assert [s.generation for s in host.sent("stopped")] == [1]

    run(scenario())


def test_a_stop_without_dump_stacks_takes_no_stacks(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        await host.supervisor.stop(Stop(generation=1, grace_s=5.0, reason="drain"))
        assert host.dumper.asked == []
        assert list((tmp_path / "generations" / "000001").glob("*.stacks.txt")) == []

    run(scenario())


# ---------------------------------------------------------------- graceful exit


def test_request_exit_writes_the_graceful_exit_file_and_the_next_launch_removes_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        workdir = tmp_path / "user-job"
        exit_file = workdir / "config" / "exit.json"
        await host.supervisor.launch(launch(1, workdir=str(workdir), graceful_exit_file="config/exit.json"))

        await host.supervisor.request_exit(RequestExit(generation=2))  # not the running generation
        assert not exit_file.exists()
        await host.supervisor.request_exit(RequestExit(generation=1))
        assert json.loads(exit_file.read_text()) == {"GracefulExit": 1}
        assert sorted(p.name for p in exit_file.parent.iterdir()) == ["exit.json"]

        await host.supervisor.launch(launch(2, workdir=str(workdir), graceful_exit_file="config/exit.json"))
        assert not exit_file.exists()
        assert host.launcher.started["rank0"].cwd_at_start == ["config"]
        assert list(exit_file.parent.iterdir()) == []  # gone before the processes started

    run(scenario())


def test_request_exit_is_ignored_when_the_launch_named_no_file(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        await host.supervisor.request_exit(RequestExit(generation=1))
        assert list((tmp_path / "jobs" / "job").iterdir()) == []

    run(scenario())


def test_a_graceful_exit_file_redirected_after_the_launch_is_not_written(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        workdir, outside = tmp_path / "user-job", tmp_path / "outside"
        outside.mkdir()
        await host.supervisor.launch(launch(1, workdir=str(workdir), graceful_exit_file="config/exit.json"))
        (workdir / "config").symlink_to(outside)  # planted by the script
        await host.supervisor.request_exit(RequestExit(generation=1))
        assert list(outside.iterdir()) == []

    run(scenario())
