"""The examples' `--min-step-ms MS`: every step lasts at least MS milliseconds, the rest of it asleep.

It stands for a larger model. A test or a demo that needs its job to run for a while (so that a fault lands
mid-run, or a pause before the end) sizes it in steps; without a floor, a step count long enough on a busy
machine runs out in a few seconds on an idle one, and one short enough on an idle machine spends a busy one's
CPU on steps nothing checks. Every rank sleeps alike after its update, so no rank waits in a collective for a
sleeping peer, and the reported step time includes the sleep, as a larger model's would.
"""

from __future__ import annotations

import argparse
import time


def min_step_ms(text: str) -> float:
    """MS, a number of milliseconds from 0 to 10,000 (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 10_000:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of milliseconds from 0 to 10000")
    return value


def pad_step(began: float, min_ms: float) -> None:
    """Sleep until `min_ms` milliseconds have passed since `began` (a time.perf_counter() reading)."""
    left = began + min_ms / 1000 - time.perf_counter()
    if left > 0:
        time.sleep(left)
