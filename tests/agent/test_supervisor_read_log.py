"""ReadLog: part of a process's log, found by numbers under the agent's generations directory only."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from agent.commands import ReadLog, RequestExit
from agent.config import AgentConfig
from agent.log_reader import MAX_LOG_READ_BYTES
from agent.main import Agent
from agent.systemd import SystemdNotifier
from proto import trainerd_pb2 as pb
from tests.agent.supervisor_fakes import Host, launch, run

OUTPUT = b"".join(b"line %02d\n" % n for n in range(10))  # 80 bytes


async def read(host: Host, generation: int = 1, role: str = "worker", rank: int = 1, offset: int = 0,
               max_bytes: int = 1000) -> pb.LogData:
    return await host.supervisor.read_log(ReadLog(request_id=7, generation=generation, role=role, rank=rank,
                                                     offset=offset, max_bytes=max_bytes))


def test_a_log_is_read_from_an_offset_or_from_its_end(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        host.launcher.started["rank1"].write(OUTPUT.decode())

        whole = await read(host)
        assert (whole.request_id, whole.data, whole.offset, whole.size, whole.running, whole.error) == (
            7, OUTPUT, 0, 80, True, "")
        assert ((await read(host, offset=72)).data, (await read(host, offset=72)).offset) == (b"line 09\n", 72)
        tail = await read(host, offset=-16)
        assert (tail.data, tail.offset, tail.size) == (b"line 08\nline 09\n", 64, 80)
        assert (await read(host, offset=-1000)).offset == 0
        past_the_end = await read(host, offset=500)
        assert (past_the_end.data, past_the_end.offset, past_the_end.size) == (b"", 80, 80)
        assert (await read(host, offset=8, max_bytes=8)).data == b"line 01\n"
        assert (await read(host, max_bytes=0)).data == b""

    run(scenario())


def test_a_read_is_capped_at_one_mib(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1, workers=1))
        host.launcher.started["rank0"].write("x" * (MAX_LOG_READ_BYTES + 1000))
        answer = await read(host, rank=0, max_bytes=8 * MAX_LOG_READ_BYTES)
        assert (len(answer.data), answer.size) == (MAX_LOG_READ_BYTES, MAX_LOG_READ_BYTES + 1000)

    run(scenario())


def test_running_is_true_only_for_a_running_process_of_the_current_generation(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        host.launcher.started["scheduler"].write("scheduler up\n")
        scheduler = await read(host, role="scheduler", rank=-1)
        assert (scheduler.data, scheduler.running) == (b"scheduler up\n", True)
        host.launcher.started["rank1"].exit(1, "boom\n")
        await host.exited("rank1")
        assert (await read(host)).running is False

        await host.supervisor.launch(launch(2))
        host.launcher.started["rank0"].write("generation 2\n")
        older = await read(host, generation=1, rank=0)
        assert (older.data, older.running, older.error) == (b"", False, "")
        assert (await read(host, generation=1)).data == b"boom\n"
        current = await read(host, generation=2, rank=0)
        assert (current.data, current.running) == (b"generation 2\n", True)

    run(scenario())


def test_a_log_that_does_not_exist_or_cannot_be_named_is_a_one_line_error(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(2))
        (tmp_path / "secret").write_text("not a log")
        assert (await read(host, generation=2, rank=7)).error == "no log for worker 7 of generation 2"
        assert (await read(host, generation=9, rank=0)).error == "no log for worker 0 of generation 9"
        assert (await read(host, generation=0, rank=0)).error == "no log for worker 0 of generation 0"
        assert (await read(host, generation=2, rank=-3)).error == "no log for worker -3 of generation 2"
        escaping = await read(host, generation=2, role="../../secret", rank=0)
        assert escaping.error == "no log for a process of role '../../secret' in generation 2"
        assert escaping.data == b""

    run(scenario())


def test_a_log_replaced_by_a_symlink_is_not_followed(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1))
        secret = tmp_path / "secret"
        secret.write_text("private key")
        log_file = host.launcher.started["rank0"].log_path
        log_file.unlink()
        os.symlink(secret, log_file)
        answer = await read(host, rank=0)
        assert answer.error == "cannot read the log of worker 0 of generation 1: Too many levels of symbolic links"
        assert answer.data == b""

    run(scenario())


class RecordingLink:
    def __init__(self) -> None:
        self.sent: list[pb.AgentMessage] = []

    def send(self, message: pb.AgentMessage) -> None:
        self.sent.append(message)


def test_the_agent_answers_read_log_and_request_exit_commands(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        link = RecordingLink()
        agent = Agent(AgentConfig(coordinator=["127.0.0.1:1"], work_dir=str(tmp_path)), link=link,  # type: ignore[arg-type]
                      supervisor=host.supervisor, notifier=SystemdNotifier(), clock=host.clock, launcher=host.launcher)
        workdir = tmp_path / "user-job"
        await host.supervisor.launch(launch(1, workdir=str(workdir), graceful_exit_file="exit.json"))
        host.launcher.started["rank0"].write("epoch: 1 step: 1, loss is 0.5\n")

        agent.on_command(ReadLog(request_id=3, generation=1, role="worker", rank=0, offset=-100, max_bytes=100))
        agent.on_command(RequestExit(generation=1))
        while not link.sent or not (workdir / "exit.json").exists():
            await asyncio.sleep(0)
        assert (workdir / "exit.json").read_bytes() == b'{"GracefulExit": 1}'
        (message,) = link.sent
        assert message.log_data == pb.LogData(request_id=3, data=b"epoch: 1 step: 1, loss is 0.5\n", offset=0,
                                              size=30, running=True)

    run(scenario())
