"""Settings gRPC's core reads from the environment once, as `grpc` is imported. The coordinator's and the
agent's entry modules (`daemon/cli/trainerd_main.py`, `agent/main.py`) call `apply()` before anything
else, so every trainerd and agent process runs gRPC this way; the variable is then taken back out of
the environment, so the processes they start (workers, etcd) see the environment they were given.

`GRPC_EXPERIMENTS=-event_engine_client,-event_engine_listener`: connections are made and accepted by gRPC's
iomgr TCP endpoints rather than its EventEngine ones. With the EventEngine endpoints (gRPC's default since
1.6x), a coordinator taking 10,000 agents connecting at once left streams silent in both directions for 5 to 60
s while their connections still answered keepalive pings. In the bench (`bench/heartbeats.py --agents 10000
--seconds 20 --max-per-s 2000 --max-opening 256`), six runs with them broke 1,353 to 3,229 sessions (median
1,692); seven with these two off broke 0 to 1,709 (median 440). Silent streams are rarer, not gone
(bench/heartbeats.md has every run and its conditions). gRPC gave the same two switches as the way around its
1.68 keepalive regression (grpc/grpc#39113). An operator who sets GRPC_EXPERIMENTS (even to nothing) decides
instead. A grpcio that no longer knows an experiment logs "Unknown experiment" and goes on
(tests/test_grpc_core_settings.py fails then): check this against the bench on every grpcio upgrade.
"""

from __future__ import annotations

import importlib
import os
import sys

GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def apply() -> None:
    """Import `grpc` with the settings above in the environment (unless it names its own), then take them
    back out. Does nothing once `grpc` is imported: its core has read the environment by then."""
    if "grpc" in sys.modules:
        return
    ours = "GRPC_EXPERIMENTS" not in os.environ
    if ours:
        os.environ["GRPC_EXPERIMENTS"] = GRPC_EXPERIMENTS
    try:
        importlib.import_module("grpc")
    finally:
        if ours:
            del os.environ["GRPC_EXPERIMENTS"]
