"""Worker side of the progress channel: datagrams to the agent that training never waits for.

A step report is fire-and-forget: when the agent's receive queue is full (Linux queues only
`net.unix.max_dgram_qlen` datagrams per socket, 10 by default) or no agent listens (it restarted,
or the script runs by hand with a stale variable), the report is dropped and counted, and the next
step's report supersedes it. Events (`started`, `finished`), committed and failed checkpoints and bad batches
are rare and superseded by nothing: each waits up to `event_wait_s` for room in a full queue, never for an
agent that is not there.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from types import TracebackType

from proto.progress_datagram import (
    BadBatchReason,
    BadBatchReport,
    CheckpointFailedReport,
    CheckpointReport,
    EventReport,
    GuardNotice,
    GuardNoticeReport,
    ProgressMessage,
    StartupTimes,
    StepReport,
    WarningReport,
    WorkerEvent,
    encode,
    one_line,
)
from trainer.runtime import startup_times
from trainer.runtime.rank_context import RankContext

log = logging.getLogger(__name__)

EVENT_WAIT_S = 1.0
# While a rank evaluates, the agent hears so as an evaluation begins and then at most this often.
EVALUATING_EVERY_S = 5.0
_RETRY_S = 0.005


class StepPace:
    """The samples per second a step report carries: the step's samples over the wall time since the
    previous step ended, so the time between steps (the data pipeline, callbacks, saves) counts; the
    first step is timed from when it began. The coordinator asks for a checkpoint a couple of seconds of
    steps ahead at this pace: timed from step begin to step end only, a job with gaps between its steps
    (`Model.train` with a slow dataset) read as many times faster than it trains, and a requested
    checkpoint came hundreds of steps late."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._last_end: float | None = None

    def step_ended(self, samples: int, began_at: float) -> float:
        """A step of `samples` that began at `began_at` (on this pace's clock) ended: its samples per second."""
        now = self._clock()
        since = began_at if self._last_end is None else self._last_end
        self._last_end = now
        return samples / max(now - since, 1e-9)


class ProgressReporter:
    """Sends this rank's step reports and events to the socket named by TRAINERD_PROGRESS_SOCKET.

    Without a socket path (a user running the script by hand) every call is a no-op.
    """

    def __init__(self, socket_path: str | None, job: str, generation: int, rank: int,
                 event_wait_s: float = EVENT_WAIT_S) -> None:
        self._path = socket_path
        self._event_wait_s = event_wait_s
        self._job = job
        self._generation = generation
        self._rank = rank
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if socket_path else None
        self.sent = 0
        self.dropped = 0
        # Seconds this rank's step loop was blocked on checkpoint saves: every step report carries the sum.
        self.checkpoint_stall_s = 0.0
        self._evaluating_told: float | None = None  # when the agent last heard that this rank evaluates
        # When `started` was reported; the first step report after it carries the start-up's times, once.
        self._started_at: float | None = None
        self._startup_sent = False

    @classmethod
    def for_rank(cls, ctx: RankContext) -> ProgressReporter:
        if ctx.rank is None:
            raise ValueError("the scheduler process has no rank and reports no progress")
        return cls(ctx.progress_socket, ctx.job, ctx.generation, ctx.rank)

    def step(self, step: int, loss: float, grad_norm: float, samples_per_s: float, consumed_samples: int,
             epoch: int | None = None) -> None:
        startup = None
        if not self._startup_sent and self._started_at is not None:
            startup = StartupTimes.measured(startup_times.comm_setup_s(), startup_times.load_s(),
                                            time.monotonic() - self._started_at)
            self._startup_sent = True
        self._send(StepReport(
            job=self._job, generation=self._generation, rank=self._rank, step=step, loss=loss,
            grad_norm=grad_norm, samples_per_s=samples_per_s, consumed_samples=consumed_samples,
            checkpoint_stall_s=self.checkpoint_stall_s, epoch=epoch, startup=startup,
        ))

    def add_checkpoint_stall(self, seconds: float) -> None:
        """The step loop was blocked `seconds` on a checkpoint save (TrainingCheckpoints tells)."""
        self.checkpoint_stall_s += max(0.0, seconds)

    def event(self, event: WorkerEvent, step: int) -> None:
        """Report an event; send it outside the step loop, as it may wait up to `event_wait_s`."""
        if event is WorkerEvent.STARTED and self._started_at is None:
            self._started_at = time.monotonic()
        message = EventReport(job=self._job, generation=self._generation, rank=self._rank, event=event, step=step)
        self._send(message, wait_s=self._event_wait_s)

    def evaluating(self, step: int, first: bool) -> None:
        """Between steps, evaluating: alive at `step`, which holds off the hang judgement. Called as an
        evaluation begins (`first`) and at each of its steps; sent as it begins and then at most every
        EVALUATING_EVERY_S (far inside any hang_timeout_s, and few datagrams for an evaluation of thousands
        of batches), like a step report, never waiting."""
        now = time.monotonic()
        if not first and self._evaluating_told is not None and now - self._evaluating_told < EVALUATING_EVERY_S:
            return
        self._evaluating_told = now
        self._send(EventReport(job=self._job, generation=self._generation, rank=self._rank,
                               event=WorkerEvent.EVALUATING, step=step))

    def checkpoint(self, step: int, consumed_samples: int, path: str) -> None:
        """Report that the checkpoint of `step` in directory `path` is committed (rank 0 only; may wait
        up to `event_wait_s`)."""
        message = CheckpointReport(job=self._job, generation=self._generation, rank=self._rank, step=step,
                                   consumed_samples=consumed_samples, path=path)
        self._send(message, wait_s=self._event_wait_s)

    def checkpoint_failed(self, step: int, reason: str) -> None:
        """Report that this rank's save of `step` failed and why (one line: see
        `proto.progress_datagram.failure_reason`; may wait up to `event_wait_s`)."""
        message = CheckpointFailedReport(job=self._job, generation=self._generation, rank=self._rank, step=step,
                                         reason=reason)
        self._send(message, wait_s=self._event_wait_s)

    def bad_batch(self, step: int, sample_start: int, sample_end: int, reason: BadBatchReason,
                  loss: float, grad_norm: float) -> None:
        """Report a step whose update was skipped and the global sample range it read (rank 0 only; may
        wait up to `event_wait_s`)."""
        message = BadBatchReport(job=self._job, generation=self._generation, rank=self._rank, step=step,
                                 sample_start=sample_start, sample_end=sample_end, reason=reason, loss=loss,
                                 grad_norm=grad_norm)
        self._send(message, wait_s=self._event_wait_s)

    def guard_notice(self, step: int, notice: GuardNotice, detail: str) -> None:
        """Report what a replay of step `step` found other than bad data (may wait up to `event_wait_s`)."""
        message = GuardNoticeReport(job=self._job, generation=self._generation, rank=self._rank, step=step,
                                    notice=notice, detail=one_line(detail))
        self._send(message, wait_s=self._event_wait_s)

    def warning(self, step: int, text: str) -> None:
        """Report what may work but is risky about the job, found at `step` (rank 0 only; the coordinator keeps
        it as a job warning; may wait up to `event_wait_s`)."""
        message = WarningReport(job=self._job, generation=self._generation, rank=self._rank, step=step,
                                text=one_line(text))
        self._send(message, wait_s=self._event_wait_s)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _send(self, message: ProgressMessage, wait_s: float = 0.0) -> None:
        if self._sock is None or self._path is None:  # the socket exists exactly when the path does
            return
        data = encode(message)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self._sock.sendto(data, socket.MSG_DONTWAIT, self._path)
            except BlockingIOError as exc:  # the agent is there but its queue is full
                if time.monotonic() < deadline:
                    time.sleep(_RETRY_S)
                    continue
                self._drop(exc)
            except OSError as exc:  # no socket file, or nobody bound to it
                self._drop(exc)
            else:
                self.sent += 1
            return

    def _drop(self, exc: OSError) -> None:
        self.dropped += 1
        if self.dropped == 1:
            log.warning("Rank %d could not report progress to %s (%s); dropping reports the agent cannot take",
                        self._rank, self._path, exc.strerror or exc)
