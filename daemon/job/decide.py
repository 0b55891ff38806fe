"""The job's reconcile decision: a pure function of (desired, observed, now) -> actions.

The controller (daemon/job/controller.py) gathers the inputs, calls `decide` on every pass and on
every report, and applies the actions idempotently. Nothing here does I/O or reads a clock, so
every transition is tested with plain values.
"""

from __future__ import annotations

from dataclasses import dataclass

from daemon.config import JobSettings
from daemon.job.observation import GenerationObservation
from daemon.job.placement import NodeOffer, Placement, place
from daemon.job.state import Failure, GenerationRecord, JobRecord
from proto.vocabulary import JobState


@dataclass(frozen=True)
class LaunchGeneration:
    placement: Placement


@dataclass(frozen=True)
class StopGeneration:
    reason: str


@dataclass(frozen=True)
class SetJobState:
    state: JobState
    failure: Failure | None = None


Action = LaunchGeneration | StopGeneration | SetJobState

ACTIVE_STATES = frozenset({JobState.PENDING, JobState.RUNNING, JobState.RECOVERING})


@dataclass(frozen=True)
class JobWorld:
    spec: JobSettings
    record: JobRecord
    generation: GenerationRecord | None  # the record's current generation, once launched
    observation: GenerationObservation | None
    offers: tuple[NodeOffer, ...]  # READY nodes that may take part
    lost_nodes: frozenset[str]
    placeable_since: float | None  # since when `offers` could hold a generation
    now: float


def decide(world: JobWorld) -> list[Action]:
    record = world.record
    if record.state not in ACTIVE_STATES:
        return _stop_leftovers(world)
    if world.generation is None:
        return _first_launch(world)
    return _watch_generation(world)


def _stop_leftovers(world: JobWorld) -> list[Action]:
    """A finished, failed or paused job must not leave processes behind."""
    observation = world.observation
    if observation is None or world.generation is None:
        return []
    running = {p.node for p in observation.processes.values() if p.running}
    unstopped = (running | (observation.launched - observation.stopped)) - observation.stop_sent
    return [StopGeneration(f"job is {world.record.state.value}")] if unstopped else []


def _first_launch(world: JobWorld) -> list[Action]:
    placement = place(world.spec, list(world.offers))
    if placement is None:
        return []
    everyone_here = len(world.offers) >= world.spec.max_nodes
    waited = world.placeable_since is not None and world.now - world.placeable_since >= world.spec.start_wait_s
    return [LaunchGeneration(placement)] if everyone_here or waited else []


def _watch_generation(world: JobWorld) -> list[Action]:
    generation, observation = world.generation, world.observation
    assert generation is not None and observation is not None
    failed = observation.first_failure()
    if failed is not None:
        failure = Failure("process_exited", failed.describe(), failed.node, failed.rank, failed.exit_code,
                          failed.signal)
        return [StopGeneration(failure.message), SetJobState(JobState.FAILED, failure)]
    lost = [node for node in generation.placement.nodes if node in world.lost_nodes]
    if lost:
        failure = Failure("node_lost", f"node {lost[0]} was lost while running generation {generation.number}",
                          lost[0])
        return [StopGeneration(failure.message), SetJobState(JobState.FAILED, failure)]
    if observation.finished_ranks() >= set(range(generation.placement.world_size)):
        return [StopGeneration("every rank finished"), SetJobState(JobState.COMPLETED)]
    if world.record.state is not JobState.RUNNING:
        first_steps = observation.min_step(generation.placement.world_size)
        if first_steps is not None and first_steps >= 1:
            return [SetJobState(JobState.RUNNING)]
    return []
