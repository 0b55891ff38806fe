"""`trainerctl logs`: a rank's log, read by its agent and relayed over the agent's session.

The operator asks the coordinator; the coordinator asks the agent of the node the rank ran on (in the
current generation or an earlier one) with a ReadLog command and waits for its LogData answer. No
SSH, and hosts need no inbound port: the answer travels on the session the agent already holds.
Each request has an id and a deadline; an answer nobody waits for any more is dropped, so nothing
here grows with unanswered requests.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from daemon.errors import PermanentError
from daemon.job.commands import ReadLogCommand

MAX_LOG_READ_BYTES = 1 << 20
LOG_READ_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class LogChunk:
    data: bytes
    offset: int  # where `data` starts in the file
    size: int  # the file's size when it was read
    running: bool  # the process is still running: more may come
    error: str = ""


class LogUnavailable(PermanentError):
    """The log cannot be read: the node is not connected, did not answer, or has no such log. Asking
    again may work once the node is back; the message says which in one line."""


class LogRelay:
    def __init__(self, send: Callable[[str, object], bool], timeout_s: float = LOG_READ_TIMEOUT_S) -> None:
        self._send = send
        self._timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[str, asyncio.Future[LogChunk]]] = {}

    async def read(self, node: str, generation: int, role: str, rank: int, offset: int,
                   max_bytes: int) -> LogChunk:
        """Raises LogUnavailable with a one-line reason."""
        request_id = next(self._ids)
        future: asyncio.Future[LogChunk] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = (node, future)
        try:
            command = ReadLogCommand(request_id, generation, role, rank, offset,
                                     max(1, min(max_bytes, MAX_LOG_READ_BYTES)))
            if not self._send(node, command):
                raise LogUnavailable(f"node {node} is not connected")
            try:
                async with asyncio.timeout(self._timeout_s):
                    chunk = await future
            except TimeoutError:
                raise LogUnavailable(f"node {node} did not answer within {self._timeout_s:.0f}s") from None
        finally:
            self._waiting.pop(request_id, None)
        if chunk.error:
            raise LogUnavailable(f"node {node}: {chunk.error}")
        return chunk

    def answer(self, node: str, request_id: int, chunk: LogChunk) -> None:
        """An agent's LogData. Only the node that was asked can answer a request."""
        waiting = self._waiting.get(request_id)
        if waiting is None or waiting[0] != node or waiting[1].done():
            return
        waiting[1].set_result(chunk)
