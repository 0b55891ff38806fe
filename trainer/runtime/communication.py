"""Bring MindSpore up for this process: GRAPH mode, the device, and data-parallel communication.

Exit protocol, which the agent relies on:
- the scheduler process never returns from `initialize`: MindSpore's `init()` serves the cluster
  and ends the process with status 0 once every worker has finished (non-zero when a worker was lost);
- a worker that completes training reports `finished` and returns 0 from its script; at interpreter
  exit MindSpore finalises the cluster, waiting for the other workers to finish too;
- SIGTERM kills any process at once by the default action (status -15, 143 in a shell), even in
  the middle of a collective, where a Python-level handler would never get to run.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import TYPE_CHECKING

from trainer.runtime import startup_times
from trainer.runtime.rank_context import RankContext, Role
from trainer.runtime.scheduler_wait import wait_for_scheduler

if TYPE_CHECKING:
    from mindspore import Parameter, nn

log = logging.getLogger(__name__)

DEVICE_TARGETS = ("CPU", "GPU", "Ascend")


class CommunicationError(RuntimeError):
    """MindSpore's view of the cluster disagrees with the environment the agent launched us with."""


def initialize(ctx: RankContext, device_target: str) -> None:
    """Set GRAPH mode and the device, and join the cluster for data parallel (not for a standalone run).

    Call it first, before building data or the network: the scheduler runs the same script and
    must do nothing but serve the cluster.
    """
    if device_target not in DEVICE_TARGETS:
        raise ValueError(f"device target {device_target!r} is not one of {', '.join(DEVICE_TARGETS)}")
    # A supervisor may have started the agent with SIGTERM ignored, and exec keeps that: restore
    # the default so that the agent's Stop always ends the process.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    import mindspore as ms
    from mindspore.communication import get_group_size, get_rank, init

    ms.set_context(mode=ms.GRAPH_MODE)
    # CPU has one device per host whatever DEVICE_ID says; accelerators are addressed by id.
    ms.set_device(device_target, None if device_target == "CPU" else ctx.device_id)
    if ctx.role is Role.STANDALONE:
        return
    log.info("Job %s generation %d: %s joining the cluster at %s",
             ctx.job, ctx.generation, _who(ctx), ctx.scheduler_address)
    started = time.monotonic()
    if not ctx.is_scheduler and ctx.scheduler_address:
        wait_for_scheduler(ctx.scheduler_address)
    init()
    if ctx.is_scheduler:
        # Not reached with MindSpore 2.10 (init() serves the cluster and exits); should a version
        # return, the scheduler must still never run the training body.
        raise SystemExit(0)
    rank, size = get_rank(), get_group_size()
    if (rank, size) != (ctx.rank, ctx.world_size):
        raise CommunicationError(
            f"MindSpore placed this process at rank {rank} of {size}, "
            f"but RANK_ID={ctx.rank} and RANK_SIZE={ctx.world_size}"
        )
    # The wait and init() are the communication set-up: MindSpore's cluster formation and mccl
    # address exchange. bench/recovery.py reads this line to show that part on its own; the first step
    # report carries it to the coordinator's recovery ledger.
    joined_in_s = time.monotonic() - started
    startup_times.joined_cluster(joined_in_s)
    log.info("Job %s generation %d: %s joined the cluster in %.3f s", ctx.job, ctx.generation, _who(ctx), joined_in_s)
    ms.set_auto_parallel_context(
        parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True, device_num=ctx.world_size
    )


def gradient_reducer(ctx: RankContext, parameters: list[Parameter]) -> nn.Cell:
    """A cell that averages gradients over all ranks (the identity when running standalone).

    Build it after `initialize`, from the parameters the optimizer updates.
    """
    from mindspore import nn

    if ctx.world_size == 1:
        return nn.Identity()
    return nn.DistributedGradReducer(parameters, mean=True, degree=ctx.world_size)


def _who(ctx: RankContext) -> str:
    return "the scheduler" if ctx.is_scheduler else f"rank {ctx.rank} of {ctx.world_size}"
