"""This process's start-up, timed as it happens, for its first step report (StartupTimes in
proto/progress_datagram.py): the coordinator splits a recovery's cost with it (daemon/job/timeline.py).

A training process is one rank of one generation, so the figures are the process's own: joining the
cluster (`trainer.runtime.communication.initialize`) and loading the state it resumes from
(`TrainingCheckpoints.resume`) note theirs here; the ProgressReporter times the first step itself.
"""

from __future__ import annotations

_seconds = {"comm_setup_s": 0.0, "load_s": 0.0}


def joined_cluster(seconds: float) -> None:
    """Waiting for the scheduler and MindSpore's `init()` took `seconds`."""
    _seconds["comm_setup_s"] = max(0.0, seconds)


def loaded(seconds: float) -> None:
    """Loading the checkpoint or snapshot this process resumes from took `seconds`."""
    _seconds["load_s"] = max(0.0, seconds)


def comm_setup_s() -> float:
    return _seconds["comm_setup_s"]


def load_s() -> float:
    return _seconds["load_s"]
