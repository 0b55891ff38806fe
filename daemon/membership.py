"""The nodes of the cluster as etcd records them: written only when a node's state changes."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from daemon.store import codec, keys
from daemon.leader import LeadershipLost
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
        self._store = store
        self._records: dict[str, NodeRecord] = {}
        self._revisions: dict[str, int] = {}

    async def load(self) -> None:
        kvs, _ = await self._store.get_prefix(keys.NODES)
        self._records.clear()
        self._revisions.clear()
        for kv in kvs:
            record = NodeRecord.from_json(codec.decode(kv.value, key=kv.key))
            self._records[record.name] = record
            self._revisions[record.name] = kv.mod_revision

    def get(self, name: str) -> NodeRecord | None:
        return self._records.get(name)

    def all(self) -> list[NodeRecord]:
        return [self._records[name] for name in sorted(self._records)]

    async def put(self, record: NodeRecord, fence: Fence) -> None:
        key = keys.node(record.name)
        revision = await self._store.compare_and_swap(
            key, codec.encode(record.to_json()), self._revisions.get(record.name, 0), fence=fence
        )
        if revision is None:
            raise LeadershipLost(f"write of {key} refused: leadership or the record changed")
        self._records[record.name] = record
        self._revisions[record.name] = revision

    async def set_state(self, name: str, state: NodeState, at: float, fence: Fence) -> NodeRecord:
        record = replace(self._records[name], state=state, changed_at=at)
        await self.put(record, fence)
        return record

    async def set_drained(self, name: str, drained: bool, fence: Fence) -> NodeRecord:
        record = replace(self._records[name], drained=drained)
        await self.put(record, fence)
        return record
