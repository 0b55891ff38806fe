"""Which devices a generation runs on, and with how much gradient accumulation.

Pure: from the nodes on offer and the previous generation's node order, choose the world size
(the largest allowed one that fits, docs/concepts/generations.md) and give every rank a device.
`place_keeping_spares` holds job.spare_nodes of the offers back (the launch and growth targets);
`place_replacing_lost` lets those spares fill in for lost nodes at the world size the job had.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from daemon.config import JobSettings
from daemon.membership import DeviceInfo


@dataclass(frozen=True)
class NodeOffer:
    """A READY node that may take part (not drained, not quarantined)."""

    name: str
    host: str
    devices: tuple[DeviceInfo, ...]
    peer_port: int = 0  # its agent's SnapshotPeer port (0: it serves none)

    @property
    def peer_address(self) -> str:
        """host:port of its agent's SnapshotPeer service ("" when it serves none)."""
        if not self.peer_port:
            return ""
        return f"[{self.host}]:{self.peer_port}" if ":" in self.host else f"{self.host}:{self.peer_port}"


@dataclass(frozen=True)
class RankSlot:
    rank: int
    node: str
    host: str
    device_id: int
    device_ip: str
    local_rank: int

    def to_json(self) -> dict:
        return {"rank": self.rank, "node": self.node, "host": self.host, "device_id": self.device_id,
                "device_ip": self.device_ip, "local_rank": self.local_rank}

    @classmethod
    def from_json(cls, data: dict) -> "RankSlot":
        return cls(int(data["rank"]), str(data["node"]), str(data["host"]), int(data["device_id"]),
                   str(data["device_ip"]), int(data["local_rank"]))


@dataclass(frozen=True)
class Placement:
    world_size: int
    grad_accum: int
    ranks: tuple[RankSlot, ...]

    @property
    def nodes(self) -> list[str]:
        """Participating nodes in rank order (the first one also runs the MindSpore scheduler)."""
        seen: dict[str, None] = {}
        for slot in self.ranks:
            seen.setdefault(slot.node)
        return list(seen)

    @property
    def scheduler_host(self) -> str:
        return self.ranks[0].host

    @property
    def scheduler_node(self) -> str:
        """The node of rank 0, which also runs the MindSpore scheduler."""
        return self.ranks[0].node

    def node_of(self, rank: int) -> str | None:
        """The node `rank` runs on; None for a rank this placement does not have."""
        return self._node_by_rank.get(rank)

    @cached_property
    def _node_by_rank(self) -> dict[int, str]:
        return {slot.rank: slot.node for slot in self.ranks}

    def to_json(self) -> dict:
        return {"world_size": self.world_size, "grad_accum": self.grad_accum,
                "ranks": [r.to_json() for r in self.ranks]}

    @classmethod
    def from_json(cls, data: dict) -> "Placement":
        return cls(int(data["world_size"]), int(data["grad_accum"]),
                   tuple(RankSlot.from_json(r) for r in data["ranks"]))


def node_order(offers: list[NodeOffer], previous_order: list[str]) -> list[NodeOffer]:
    """Survivors keep their relative order from the previous generation; newcomers follow by name."""
    position = {name: i for i, name in enumerate(previous_order)}
    return sorted(offers, key=lambda o: (0, position[o.name]) if o.name in position else (1, o.name))


def place_keeping_spares(spec: JobSettings, offers: list[NodeOffer], previous_order: Sequence[str] = (),
                         orders_seen: Mapping[int, Sequence[str]] | None = None) -> Placement | None:
    """`place` on the offers less up to `spec.spare_nodes` of them, the last in node order (newcomers, never
    a node of the previous generation before them): as many held back as still leave a placement."""
    ordered = node_order(offers, list(previous_order))
    for held in range(min(spec.spare_nodes, len(ordered)), -1, -1):
        placement = place(spec, ordered[:len(ordered) - held], previous_order, orders_seen)
        if placement is not None:
            return placement
    return None


def place_replacing_lost(spec: JobSettings, offers: list[NodeOffer], world_size: int,
                         previous_order: Sequence[str] = (),
                         orders_seen: Mapping[int, Sequence[str]] | None = None) -> Placement | None:
    """The next generation after a fault in a generation of `world_size`: the spares fill in for the nodes
    it lost, up to that world size (the same world size: no reshard, no new graph), unless the target with
    spares held back is larger still."""
    target = place_keeping_spares(spec, offers, previous_order, orders_seen)
    if target is not None and target.world_size >= world_size:
        return target
    refilled = place(spec, offers, previous_order, orders_seen, max_world_size=world_size)
    if refilled is None or (target is not None and target.world_size >= refilled.world_size):
        return target
    return refilled


def place(spec: JobSettings, offers: list[NodeOffer], previous_order: Sequence[str] = (),
          orders_seen: Mapping[int, Sequence[str]] | None = None,
          max_world_size: int | None = None) -> Placement | None:
    """The largest valid placement on `offers` (of at most `max_world_size` ranks when given), or None when too
    few devices are on offer.

    `orders_seen`: the node order of the last generation at each world size. When the placement comes
    back to a world size on the very nodes it had then (a lost node regrown into the job), those nodes
    take their ranks of then: each process then finds the compile cache (per rank and configuration)
    and the warm worker it left, where a newcomer appended after the survivors would move ranks around
    and recompile on every host whose rank changed."""
    placement = _place(spec, offers, previous_order, max_world_size)
    seen = (orders_seen or {}).get(placement.world_size) if placement is not None else None
    if placement is None or seen is None or placement.nodes == list(seen) or set(placement.nodes) != set(seen):
        return placement
    restored = _place(spec, offers, seen, max_world_size)
    return restored if restored is not None and restored.world_size == placement.world_size else placement


def usable_devices(spec: JobSettings, offer: NodeOffer) -> list[DeviceInfo]:
    """The devices of `offer` a placement gives ranks: the first devices_per_node by device id."""
    return sorted(offer.devices, key=lambda d: d.device_id)[: spec.devices_per_node]


def _place(spec: JobSettings, offers: list[NodeOffer], previous_order: Sequence[str],
           max_world_size: int | None) -> Placement | None:
    ordered = node_order(offers, list(previous_order))
    usable = [(o, usable_devices(spec, o)) for o in ordered]
    available = sum(len(devices) for _, devices in usable)
    nodes_with_devices = sum(1 for _, devices in usable if devices)
    if nodes_with_devices < spec.min_nodes:
        return None
    fitting = [w for w in spec.allowed_world_sizes() if w <= available and w <= (max_world_size or w)]
    if not fitting:
        return None
    world_size = fitting[0]
    ranks: list[RankSlot] = []
    for offer, devices in usable:
        for local_rank, device in enumerate(devices):
            if len(ranks) == world_size:
                break
            ranks.append(RankSlot(len(ranks), offer.name, offer.host, device.device_id, device.device_ip,
                                  local_rank))
    grad_accum = spec.grad_accum(world_size)
    return Placement(world_size, grad_accum, tuple(ranks))
