"""The nodes of the cluster as etcd records them: written only when a node's state changes."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from daemon.store import keys
from daemon.store.fenced_cache import FencedCache
from daemon.store.interface import Fence, Store
from proto.vocabulary import NodeState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceInfo:
    device_id: int
    device_ip: str
    kind: str  # "npu" or "cpu"

    def to_json(self) -> dict:
        return {"device_id": self.device_id, "device_ip": self.device_ip, "kind": self.kind}

    @classmethod
    def from_json(cls, data: dict) -> "DeviceInfo":
        return cls(int(data["device_id"]), str(data["device_ip"]), str(data["kind"]))


@dataclass(frozen=True)
class NodeRecord:
    name: str
    host: str
    devices: tuple[DeviceInfo, ...]
    state: NodeState
    changed_at: float  # wall-clock seconds of the last state change
    drained: bool = False  # an operator took it out of service (`trainerctl nodes drain`)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "host": self.host,
            "devices": [d.to_json() for d in self.devices],
            "state": self.state.value,
            "changed_at": self.changed_at,
            "drained": self.drained,
        }

    @classmethod
    def from_json(cls, data: dict) -> "NodeRecord":
        return cls(
            name=str(data["name"]),
            host=str(data["host"]),
            devices=tuple(DeviceInfo.from_json(d) for d in data["devices"]),
            state=NodeState(data["state"]),
            changed_at=float(data["changed_at"]),
            drained=bool(data.get("drained", False)),
        )


class Membership:
    """In-memory mirror of `nodes/*`, written through to etcd with fenced compare-and-swap."""

    def __init__(self, store: Store) -> None:
        self._nodes = FencedCache(store, keys.NODES, NodeRecord.from_json)

    async def load(self) -> None:
        await self._nodes.load()

    def get(self, name: str) -> NodeRecord | None:
        return self._nodes.get(keys.node(name))

    def all(self) -> list[NodeRecord]:
        """By name."""
        return self._nodes.values()

    async def put(self, record: NodeRecord, fence: Fence) -> None:
        await self._nodes.put(keys.node(record.name), record, fence)

    async def set_state(self, name: str, state: NodeState, at: float, fence: Fence) -> NodeRecord:
        record = replace(self._known(name), state=state, changed_at=at)
        await self.put(record, fence)
        return record

    async def forget(self, name: str, fence: Fence) -> bool:
        """The node leaves the records (a departed node); False when there was none."""
        return await self._nodes.delete(keys.node(name), fence)

    async def set_drained(self, name: str, drained: bool, fence: Fence) -> NodeRecord:
        record = replace(self._known(name), drained=drained)
        await self.put(record, fence)
        return record

    def _known(self, name: str) -> NodeRecord:
        record = self.get(name)
        if record is None:
            raise KeyError(f"no node named {name} in etcd")
        return record
