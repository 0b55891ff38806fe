"""The log relay: one request, one answer from the node that was asked, a deadline, nothing left behind."""

from __future__ import annotations

import asyncio

import pytest

from daemon.job.commands import ReadLogCommand
from daemon.log_relay import MAX_LOG_READ_BYTES, LogChunk, LogRelay, LogUnavailable


def test_the_asked_node_answers_and_the_reader_gets_its_bytes() -> None:
    async def scenario() -> None:
        sent: list[tuple[str, ReadLogCommand]] = []
        relay = LogRelay(lambda node, command: sent.append((node, command)) or True)
        reader = asyncio.create_task(relay.read("n1", 3, "worker", 1, -100, 10 << 20))
        await asyncio.sleep(0)
        node, command = sent[0]
        assert (node, command.generation, command.rank, command.offset) == ("n1", 3, 1, -100)
        assert command.max_bytes == MAX_LOG_READ_BYTES  # capped
        relay.answer("n2", command.request_id, LogChunk(b"forged", 0, 6, False))  # not the node asked
        relay.answer("n1", command.request_id, LogChunk(b"epoch: 1 step: 2", 40, 56, True))
        chunk = await reader
        assert chunk.data == b"epoch: 1 step: 2" and chunk.running
        assert relay._waiting == {}

    asyncio.run(scenario())


@pytest.mark.parametrize(("connected", "answer", "expected"), [
    (False, None, "node n1 is not connected"),
    (True, None, "node n1 did not answer"),
    (True, LogChunk(b"", 0, 0, False, "no log for worker 7 of generation 2"), "node n1: no log for worker 7"),
])
def test_failures_are_one_line_and_leave_nothing_waiting(connected: bool, answer: LogChunk | None,
                                                          expected: str) -> None:
    async def scenario() -> None:
        sent: list[ReadLogCommand] = []

        def send(node: str, command: object) -> bool:
            assert isinstance(command, ReadLogCommand)
            sent.append(command)
            return connected

        relay = LogRelay(send, timeout_s=0.05)
        reader = asyncio.create_task(relay.read("n1", 2, "worker", 7, 0, 100))
        await asyncio.sleep(0)
        if answer is not None:
            relay.answer("n1", sent[0].request_id, answer)
        with pytest.raises(LogUnavailable, match=expected):
            await reader
        assert relay._waiting == {}

    asyncio.run(scenario())
