"""Which of a node's in-memory snapshot claims the coordinator believes (issue 47).

A relaunch fetches every rank's files from the nodes that claim them (daemon/job/decide.py), so a claim
is a promise about the job's weights: believed only from a node the coordinator told to hold them, and
only for a step the job can have reached. A node of the current generation's placement may claim
- a snapshot held whole (a one-host generation's), and
- the files of a generation spanning hosts, for the ranks it was told to hold: its own ranks in the
  generation that wrote them, and those of its ring predecessor (launch_plan.ring_predecessor, whose
  snapshots it copies) in that generation or a later one whose Launch named it, and only at that
  generation's world size;
and no step beyond the newest the job reported (nor beyond what a checkpoint manifest records). Anything
else is dropped, with why: a node outside the job that claimed every rank at step 10**9 was the relaunch's
only source, and its files were loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from daemon.job.launch_plan import ring_predecessor
from daemon.job.observation import MemorySnapshot
from daemon.job.placement import Placement
from daemon.message_checks import MAX_STEP


@dataclass(frozen=True)
class Claims:
    """What is believed of one report, and why each claim left out was (one line each)."""

    memory: MemorySnapshot | None
    held: tuple[MemorySnapshot, ...]
    refused: tuple[str, ...] = ()


def ranks_on(placement: Placement, node: str | None) -> frozenset[int]:
    return frozenset(slot.rank for slot in placement.ranks if slot.node == node)


def ranks_told_to_hold(node: str, generation: int, placements: Mapping[int, Placement]) -> frozenset[int]:
    """The ranks of `generation` whose files `node` may hold: its own then, and its ring predecessor's
    then, for each generation from that one on in which it copied that predecessor (`placements`: the
    generations the coordinator knows, by number)."""
    wrote = placements.get(generation)
    if wrote is None:
        return frozenset()
    ranks = set(ranks_on(wrote, node))
    for number, placement in placements.items():
        if number >= generation:
            ranks |= ranks_on(wrote, ring_predecessor(placement, node))
    return frozenset(ranks)


def admitted(node: str, memory: MemorySnapshot | None, held: tuple[MemorySnapshot, ...],
             placements: Mapping[int, Placement], current: int, reached_step: int) -> Claims:
    """The claims of `node`'s report that bind: see the module's docstring. `current`: the generation the
    node runs; `reached_step`: the newest step the job reported (or resumed from, or committed)."""
    placement = placements.get(current)
    if placement is None or node not in placement.nodes:
        if memory is None and not held:
            return Claims(None, ())
        return Claims(None, (), (f"node {node} is not in generation {current}'s placement: it was told to hold no "
                                 f"snapshot",))
    bound = min(reached_step, MAX_STEP)
    refused = []

    def reachable(snapshot: MemorySnapshot) -> bool:
        if snapshot.step <= bound:
            return True
        refused.append(f"step {snapshot.step} is beyond step {bound}, the newest the job reported")
        return False

    if memory is not None and not reachable(memory):
        memory = None
    kept = []
    for snapshot in held:
        if not reachable(snapshot):
            continue
        wrote = placements.get(snapshot.generation)
        if wrote is None or snapshot.world_size != wrote.world_size:
            refused.append(f"no generation {snapshot.generation} of world size {snapshot.world_size} is known")
            continue
        beyond = sorted(snapshot.ranks - ranks_told_to_hold(node, snapshot.generation, placements))
        if beyond:
            refused.append(f"ranks {', '.join(map(str, beyond))} of step {snapshot.step} (generation "
                           f"{snapshot.generation}) are neither node {node}'s own nor its ring predecessor's")
            continue
        kept.append(snapshot)
    return Claims(memory, tuple(kept), tuple(refused))
