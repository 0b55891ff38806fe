"""Worker side of the progress channel: fire-and-forget datagrams to the agent.

Training must never wait on its supervisor, so every send is non-blocking: when the agent's
receive queue is full, or no agent listens (it restarted, or the script runs by hand with a
stale variable), the report is dropped and counted, and the step goes on.
"""

from __future__ import annotations

import logging
import socket
from types import TracebackType

from trainer.progress_channel import EventReport, ProgressMessage, StepReport, WorkerEvent, encode
from trainer.runtime.rank_context import RankContext

log = logging.getLogger(__name__)


class ProgressReporter:
    """Sends this rank's step reports and events to the socket named by TRAINERD_PROGRESS_SOCKET.

    Without a socket path (a user running the script by hand) every call is a no-op.
    """

    def __init__(self, socket_path: str | None, job: str, generation: int, rank: int) -> None:
        self._path = socket_path
        self._job = job
        self._generation = generation
        self._rank = rank
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if socket_path else None
        self.sent = 0
        self.dropped = 0

    @classmethod
    def for_rank(cls, ctx: RankContext) -> ProgressReporter:
        if ctx.rank is None:
            raise ValueError("the scheduler process has no rank and reports no progress")
        return cls(ctx.progress_socket, ctx.job, ctx.generation, ctx.rank)

    def step(self, step: int, loss: float, grad_norm: float, samples_per_s: float, consumed_samples: int) -> None:
        self._send(StepReport(
            job=self._job, generation=self._generation, rank=self._rank, step=step, loss=loss,
            grad_norm=grad_norm, samples_per_s=samples_per_s, consumed_samples=consumed_samples,
        ))

    def event(self, event: WorkerEvent, step: int) -> None:
        self._send(EventReport(job=self._job, generation=self._generation, rank=self._rank, event=event, step=step))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _send(self, message: ProgressMessage) -> None:
        if self._sock is None:
            return
        data = encode(message)
        try:
            self._sock.sendto(data, socket.MSG_DONTWAIT, self._path)
        except OSError as exc:  # queue full (EAGAIN), no socket file, nobody bound to it
            self.dropped += 1
            if self.dropped == 1:
                log.warning(
                    "Rank %d could not report progress to %s (%s); dropping reports the agent cannot take",
                    self._rank, self._path, exc.strerror or exc,
                )
            return
        self.sent += 1
