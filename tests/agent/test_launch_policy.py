"""What an agent refuses to run: an argv outside `allowed_entrypoints`, an environment that changes
which code runs. A refused Launch starts nothing and reports every process as exited 127 with why."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from agent.commands import Launch
from agent.launcher import SubprocessLauncher
from proto.vocabulary import SCHEDULER_ARGV, CauseKind
from tests.agent.supervisor_fakes import Host, launch, run


def with_process(the_launch: Launch, index: int, **fields) -> Launch:
    """`the_launch` with its process `index` changed: `fields` are ProcessSpec fields."""
    processes = list(the_launch.processes)
    processes[index] = replace(processes[index], **fields)
    return replace(the_launch, processes=tuple(processes))


def refused(host: Host, the_launch: Launch) -> str:
    """Launches; asserts that nothing started and every process exited 127 with one same message, returned."""

    async def scenario() -> str:
        await host.supervisor.launch(the_launch)
        assert host.launcher.started == {}
        exits = host.sent("process_exited")
        assert [(e.role, e.rank, e.exit_code) for e in exits] == [
            (p.role, p.rank, 127) for p in the_launch.processes]
        assert len({e.log_tail for e in exits}) == 1 and "\n" not in exits[0].log_tail
        assert not (host.work_dir / "jobs").exists()  # not even the working directory was made
        return exits[0].log_tail

    return run(scenario())


def test_by_default_only_the_agents_own_interpreter_runs(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.ERROR, "agent")
    message = refused(Host(tmp_path), launch(1, entrypoint="/bin/sh"))
    assert message == ("refused to launch ['/bin/sh', 'train.py']: it starts with none of allowed_entrypoints "
                       "[['{python}']] in the agent file")
    log_file = tmp_path / "generations" / "000001" / "rank0.log"
    assert log_file.read_text() == message + "\n"
    # The agent's own log names each process as status does (the scheduler has no rank to show).
    assert [r.getMessage() for r in caplog.records][1:3] == [
        f"the scheduler of generation 1: {message}", f"worker 0 of generation 1: {message}"]


def test_a_python_from_path_is_refused_with_what_to_write_instead(tmp_path: Path) -> None:
    for python in ("python", "/usr/bin/python3.11"):
        message = refused(Host(tmp_path / python.replace("/", "_")), launch(1, entrypoint=python))
        assert message.endswith("in the agent file (write {python} for the agent's own interpreter; a python from "
                                "PATH is never run)"), message


def test_a_prefix_of_several_words_must_match_word_for_word(tmp_path: Path) -> None:
    host = Host(tmp_path, allowed_entrypoints=[["{python}", "train.py"]])
    run(host.supervisor.launch(launch(1)))  # argv {python} train.py
    assert sorted(host.launcher.started) == ["rank0", "rank1", "scheduler"]

    other = Host(tmp_path / "other", allowed_entrypoints=[["{python}", "train"]])
    assert "it starts with none of allowed_entrypoints [['{python}', 'train']]" in refused(other, launch(1))


def test_an_empty_allowed_entrypoints_runs_nothing(tmp_path: Path) -> None:
    assert "allowed_entrypoints [] in the agent file" in refused(Host(tmp_path, allowed_entrypoints=[]), launch(1))


@pytest.mark.parametrize("name", [
    "LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONSTARTUP", "TRAINERD_HOOK",
    # issue 47: an exported bash function ran a command as root through a bash entrypoint; the others load
    # code or configuration (a warning filter's category is imported, OpenSSL loads engines, CANN custom ops)
    "BASH_FUNC_ls%%", "BASH_FUNC_x", "BASH_ENV", "ENV", "PATH", "PYTHONWARNINGS", "OPENSSL_CONF", "GCONV_PATH",
    "ASCEND_CUSTOM_OPP_PATH", "GLIBC_TUNABLES", "A=B", "1X", "",
])
def test_an_environment_that_changes_which_code_runs_is_refused(tmp_path: Path, name: str) -> None:
    the_launch = launch(1, workers=2)
    the_launch = with_process(the_launch, 2, env={**the_launch.processes[2].env, name: "/tmp/evil"})  # one is enough
    message = refused(Host(tmp_path), the_launch)
    assert message.startswith(f"refused to launch ['{{python}}', 'train.py']: its environment sets {name!r} (")


def test_the_variables_the_coordinator_sets_are_accepted(tmp_path: Path) -> None:
    the_launch = launch(1, workers=1)
    the_launch = with_process(the_launch, 1, env={**the_launch.processes[1].env, "TRAINERD_JOB": "job",
                                                  "MS_ROLE": "MS_WORKER", "GLOG_v": "3",
                                                  "MS_RETRY_INTERVAL_LOWER": "1", "DEVICE_ID": "0"})
    host = Host(tmp_path)
    run(host.supervisor.launch(the_launch))
    assert host.launcher.started["rank0"].env["MS_ROLE"] == "MS_WORKER"


def test_trainerds_own_scheduler_runs_whatever_the_allowed_entrypoints_but_only_exactly(tmp_path: Path) -> None:
    """It is trainerd's code in the agent's own interpreter (proto.vocabulary.SCHEDULER_ARGV), with no argument."""
    the_launch = with_process(launch(1), 0, argv=tuple(SCHEDULER_ARGV))
    host = Host(tmp_path, allowed_entrypoints=[["{python}", "train.py"]])
    run(host.supervisor.launch(the_launch))
    assert sorted(host.launcher.started) == ["rank0", "rank1", "scheduler"]

    the_launch = with_process(the_launch, 0, argv=(*SCHEDULER_ARGV, "--evil"))
    assert "refused to launch ['{python}', '-m', 'trainer.runtime.scheduler', '--evil']" in refused(
        Host(tmp_path / "other", allowed_entrypoints=[["{python}", "train.py"]]), the_launch)


def test_a_refused_launch_says_so_in_its_root_cause(tmp_path: Path) -> None:
    """The coordinator turns a refusal into a `launch_refused` event (CauseKind.LAUNCH_REFUSED)."""
    host = Host(tmp_path, allowed_entrypoints=[])
    refused(host, launch(1))
    assert {e.cause.kind for e in host.sent("process_exited")} == {CauseKind.LAUNCH_REFUSED}


def test_what_the_system_cannot_pass_is_reported_not_lost(tmp_path: Path) -> None:
    """Issue 47: a variable the process cannot be given raised ValueError out of the Launch, unreported, and the
    job sat PENDING. With the real launcher (the OS takes no NUL in a value) each process is reported refused."""
    async def scenario() -> None:
        host = Host(tmp_path)
        host.supervisor._launcher = SubprocessLauncher()
        the_launch = launch(1, workers=1, env={"GOOD_NAME": "a\0b"})
        await host.supervisor.launch(the_launch)
        exits = host.sent("process_exited")
        assert [(e.rank, e.exit_code, e.cause.kind) for e in exits] == [
            (-1, 127, CauseKind.LAUNCH_REFUSED), (0, 127, CauseKind.LAUNCH_REFUSED)]
        assert "null" in exits[0].cause.message
    run(scenario())
