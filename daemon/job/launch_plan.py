"""What each node runs in a generation: argv and the MindSpore dynamic-cluster environment.

No msrun: trainerd sets what msrun would (MS_ROLE, MS_SCHED_HOST/PORT, MS_WORKER_NUM, MS_NODE_ID =
rank so the rank is deterministic) plus the rank-table variables and trainerd's own: the batch
split, where checkpoints go and which one to resume from, the bad-batch guard's thresholds. The
agent adds the paths only it knows (proto.launch_env.AGENT_ENV).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from daemon.config import JobSettings
from daemon.job.placement import Placement
from daemon.job.state import ResumePoint, ResumeSource
from proto.launch_env import (
    CHECKPOINT_DIR_ENV,
    CHECKPOINT_EVERY_ENV,
    CHECKPOINT_KEEP_ENV,
    CHECKPOINT_SAVED_BY_ENV,
    GENERATION_ENV,
    GLOBAL_BATCH_ENV,
    GRAD_ACCUM_ENV,
    JOB_ENV,
    LOCAL_RANK_ENV,
    LOSS_FACTOR_ENV,
    LOSS_ZSCORE_ENV,
    MEMORY_EVERY_ENV,
    MEMORY_SCOPE_ENV,
    MICRO_BATCH_ENV,
    RESUME_FROM_ENV,
    RESUME_MEMORY_STEP_ENV,
    RESUME_SAMPLES_ENV,
    RESUME_STEP_ENV,
    SPIKE_CEILING_ENV,
    SPIKE_FACTOR_ENV,
    SPIKE_WARMUP_STEPS_ENV,
    SPIKE_ZSCORE_ENV,
)
from proto.vocabulary import PYTHON_WORD, SCHEDULER_ARGV, ProcessRole

SCHEDULER_RANK = -1

# What msrun 2.10 gives every process beyond the cluster variables (parallel/cluster/process_entity:
# MS_TOPO_TIMEOUT is its --cluster_time_out default; without it the scheduler waits 30 minutes for
# workers), then faster cluster formation and quieter logs (MS_RETRY_INTERVAL_*, GLOG_v). A job's `env` may
# override them.
DEFAULT_ENV = {
    "MS_TOPO_TIMEOUT": "600",
    "GLOG_v": "3",
    "MS_RETRY_INTERVAL_LOWER": "1",
    "MS_RETRY_INTERVAL_UPPER": "1",
}


@dataclass(frozen=True)
class ProcessPlan:
    role: ProcessRole
    rank: int
    local_rank: int
    device_id: int
    argv: tuple[str, ...]
    env: dict[str, str] = field(hash=False)


def scheduler_port(spec: JobSettings, generation: int) -> int:
    """A different port per generation, so a lingering scheduler socket never blocks the next one."""
    return spec.scheduler_port + generation % 16


def _common_env(spec: JobSettings, placement: Placement, generation: int,
                resume: ResumePoint | None, peers_serve: bool) -> dict[str, str]:
    memory_step = str(resume.step) if resume is not None and resume.source is ResumeSource.MEMORY else ""
    # A one-host generation commits each snapshot whole in its host's memory; one spanning hosts commits
    # a host's share per host ("host" scope), and only when every node's agent serves the others its
    # files (agent/snapshots/peer_service.py): a relaunch gathers the ranks' files from the hosts that hold them.
    one_host = len(placement.nodes) == 1
    memory_every = spec.checkpoint.memory_every_steps if one_host or peers_serve else 0
    env = {
        **DEFAULT_ENV,
        **spec.env,
        "MS_SCHED_HOST": placement.scheduler_host,
        "MS_SCHED_PORT": str(scheduler_port(spec, generation)),
        "MS_WORKER_NUM": str(placement.world_size),
        "RANK_SIZE": str(placement.world_size),
        JOB_ENV: spec.name,
        GENERATION_ENV: str(generation),
        CHECKPOINT_DIR_ENV: spec.checkpoint.dir or "",
        CHECKPOINT_EVERY_ENV: str(spec.checkpoint.every_steps),
        CHECKPOINT_KEEP_ENV: str(spec.checkpoint.keep),
        CHECKPOINT_SAVED_BY_ENV: spec.checkpoint.saved_by,
        # An in-memory snapshot has no path here: each agent names its own copy (agent/snapshots/memory_snapshots.py).
        RESUME_FROM_ENV: "" if resume is None else resume.path,
        RESUME_MEMORY_STEP_ENV: memory_step,
        MEMORY_EVERY_ENV: str(memory_every),
        MEMORY_SCOPE_ENV: "" if one_host else "host",
        # What the checkpoint stands for, for runners that resume by their own settings (MindFormers'
        # data_skip_steps); trainerd's own checkpoints carry both in their manifest.
        RESUME_STEP_ENV: "" if resume is None else str(resume.step),
        RESUME_SAMPLES_ENV: "" if resume is None else str(resume.consumed_samples),
        SPIKE_FACTOR_ENV: repr(spec.data_skip.spike_factor),
        SPIKE_ZSCORE_ENV: repr(spec.data_skip.spike_zscore),
        SPIKE_CEILING_ENV: repr(spec.data_skip.spike_ceiling),
        SPIKE_WARMUP_STEPS_ENV: str(spec.data_skip.warmup_steps),
        LOSS_FACTOR_ENV: repr(spec.data_skip.loss_factor),
        LOSS_ZSCORE_ENV: repr(spec.data_skip.loss_zscore),
    }
    if spec.global_batch is not None and spec.micro_batch is not None:
        env[GLOBAL_BATCH_ENV] = str(spec.global_batch)
        env[MICRO_BATCH_ENV] = str(spec.micro_batch)
        env[GRAD_ACCUM_ENV] = str(placement.grad_accum)
    return env


def scheduler_argv(spec: JobSettings) -> tuple[str, ...]:
    """What the scheduler runs: trainerd's own for a job the agent's interpreter runs, none of the job's code
    (a script that never calls init() would train a second copy in it); the job's command otherwise, as msrun
    runs it, since only that command's interpreter is sure to have the job's MindSpore."""
    return SCHEDULER_ARGV if spec.entrypoint[:1] == [PYTHON_WORD] else tuple(spec.entrypoint)


def node_processes(spec: JobSettings, placement: Placement, generation: int, node: str,
                   resume: ResumePoint | None = None, peers_serve: bool = False) -> list[ProcessPlan]:
    """The processes `node` runs: the scheduler first (on the node of rank 0), then its workers.
    `peers_serve`: every node's agent serves SnapshotPeer (a generation spanning hosts takes snapshots)."""
    common = _common_env(spec, placement, generation, resume, peers_serve)
    argv = tuple(spec.entrypoint)
    plans: list[ProcessPlan] = []
    if placement.ranks[0].node == node:
        plans.append(ProcessPlan(ProcessRole.SCHEDULER, SCHEDULER_RANK, -1, -1, scheduler_argv(spec), {
            **common, "MS_ROLE": "MS_SCHED", "RANK_ID": "0", LOCAL_RANK_ENV: "-1",
        }))
    for slot in placement.ranks:
        if slot.node != node:
            continue
        plans.append(ProcessPlan(ProcessRole.WORKER, slot.rank, slot.local_rank, slot.device_id, argv, {
            **common,
            "MS_ROLE": "MS_WORKER",
            "MS_NODE_ID": str(slot.rank),
            "RANK_ID": str(slot.rank),
            "DEVICE_ID": str(slot.device_id),
            LOCAL_RANK_ENV: str(slot.local_rank),
        }))
    return plans


def standby_processes(spec: JobSettings, placement: Placement, generation: int,
                      device_ids: Sequence[int]) -> list[ProcessPlan]:
    """The workers a spare would run on its devices `device_ids` were it to take a node's place in the
    generation after `generation` of `placement`: what the agent starts their warm templates for. Of their
    environment only what the interpreter reads at start-up must match the launch's (the job's env and
    DEVICE_ID, agent/import_env.py): the ranks, ports and generation are a launch's to give."""
    common = _common_env(spec, placement, generation, None, False)
    return [ProcessPlan(ProcessRole.WORKER, -1, local_rank, device_id, tuple(spec.entrypoint), {
        **common, "MS_ROLE": "MS_WORKER", "DEVICE_ID": str(device_id), LOCAL_RANK_ENV: str(local_rank),
    }) for local_rank, device_id in enumerate(device_ids)]


def ring_predecessor(placement: Placement, node: str) -> str | None:
    """The node whose in-memory snapshots `node` copies: the one before it in the node order, the last
    for the first (None for a one-host generation). Every node's own ranks are then held on two hosts."""
    nodes = placement.nodes
    if len(nodes) < 2 or node not in nodes:
        return None
    return nodes[nodes.index(node) - 1]
