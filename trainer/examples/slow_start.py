"""The examples' `--slow-start RANK:SECONDS`: one rank sleeps before its first step, in the first generation only.

It stands for a host that comes back cold (a first import, an empty compile cache, a busy machine): its
peers enter the first collective and wait there for it. With `MS_CPU_COMM_OP_TIMEOUT` set below SECONDS in
job.env they time out in their first AllReduce; trainerd must take that for the cluster's trouble, not the
job's own error, name the rank that never reached the collective, and relaunch (the relaunch, generation 2,
does not sleep).
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from dataclasses import dataclass

from trainer.runtime.rank_context import RankContext

log = logging.getLogger("trainer.examples.slow_start")

FIRST_GENERATION = 1  # the agent numbers a job's generations from 1 (TRAINERD_GENERATION)


@dataclass(frozen=True)
class SlowStart:
    rank: int
    seconds: float

    def wait_before_first_step(self, ctx: RankContext) -> None:
        """Sleep when this process is the slow rank of the job's first generation."""
        if ctx.rank == self.rank and ctx.generation == FIRST_GENERATION:
            log.info("rank %d: --slow-start: sleeping %g s before the first step", self.rank, self.seconds)
            time.sleep(self.seconds)


def slow_start(text: str) -> SlowStart:
    """`RANK:SECONDS` (argparse type)."""
    rank, _, seconds = text.partition(":")
    try:
        parsed = SlowStart(int(rank), float(seconds))
    except ValueError:
        parsed = None
    if parsed is None or parsed.rank < 0 or not (math.isfinite(parsed.seconds) and parsed.seconds >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not RANK:SECONDS with RANK >= 0 and SECONDS >= 0")
    return parsed
