"""FencedCache, run against the in-memory fake and against a real etcd like the contract suite.

The membership, the job's status record, its checkpoint catalog and its skip ledger all rely on
these behaviours; the lost compare-and-swap tests pin the cache's one policy (re-read the key,
then raise LeadershipLost when the fence moved, WriteConflict when it held).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from daemon.store import codec
from daemon.store.fenced_cache import FencedCache, WriteConflict
from daemon.store.interface import Fence, LeadershipLost, Store
from tests.store.backends import Backend, run

ROOT = "/trainerd/v1/test/"
PREFIX = ROOT + "things/"
LEADER = ROOT + "leader"


@dataclass(frozen=True)
class Thing:
    name: str
    size: int

    def to_json(self) -> dict:
        return {"name": self.name, "size": self.size}

    @classmethod
    def from_json(cls, data: dict) -> Thing:
        return cls(str(data["name"]), int(data["size"]))


def k(name: str) -> str:
    return PREFIX + name


def cache(store: Store) -> FencedCache[Thing]:
    return FencedCache(store, PREFIX, Thing.from_json)


async def lead(store: Store, who: str = "a") -> Fence:
    """Create the leader key (or take it over from the current holder); its revision is the fence."""
    held = await store.get(LEADER)
    revision = await store.compare_and_swap(LEADER, codec.encode({"id": who}), 0 if held is None else held.mod_revision)
    assert revision is not None
    return Fence(LEADER, revision)


async def stored(store: Store, key: str) -> Thing | None:
    kv = await store.get(key)
    return None if kv is None else Thing.from_json(codec.decode(kv.value, key=key))


async def store_revision(store: Store) -> int:
    return (await store.get_prefix(ROOT))[1]


def test_load_reads_every_key_under_the_prefix_and_nothing_else(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        for key, thing in ((k("b"), Thing("b", 2)), (k("a"), Thing("a", 1)), (ROOT + "thingsX", Thing("x", 9))):
            assert await store.compare_and_swap(key, codec.encode(thing.to_json()), 0) is not None
        things = cache(store)
        await things.load()
        assert things.values() == [Thing("a", 1), Thing("b", 2)]
        assert things.get(k("b")) == Thing("b", 2) and things.get(k("c")) is None

        assert await store.delete(k("a"))
        await things.load()  # a load replaces the copy
        assert things.values() == [Thing("b", 2)]

    run(backend, scenario)


def test_a_write_is_read_back_from_memory_and_is_in_etcd(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        fence = await lead(store)
        things = cache(store)
        await things.load()
        await things.put(k("a"), Thing("a", 1), fence)
        assert things.get(k("a")) == Thing("a", 1)
        await things.put(k("a"), Thing("a", 2), fence)  # the copy kept the new mod revision
        assert things.get(k("a")) == Thing("a", 2)
        assert await stored(store, k("a")) == Thing("a", 2)

        fresh = cache(store)
        await fresh.load()
        assert fresh.values() == [Thing("a", 2)]

    run(backend, scenario)


def test_create_writes_once_and_refuses_a_key_the_copy_holds(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        fence = await lead(store)
        things = cache(store)
        await things.load()
        assert await things.create(k("a"), Thing("a", 1), fence)
        revision = await store_revision(store)
        assert not await things.create(k("a"), Thing("a", 2), fence)
        assert await store_revision(store) == revision  # refused without a write
        assert things.get(k("a")) == Thing("a", 1) and await stored(store, k("a")) == Thing("a", 1)

    run(backend, scenario)


def test_a_write_under_a_moved_fence_is_refused_as_lost_leadership_and_the_key_re_read(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        old_fence = await lead(store, "a")
        old = cache(store)
        await old.load()
        await old.put(k("a"), Thing("a", 1), old_fence)

        new_fence = await lead(store, "b")
        new = cache(store)
        await new.load()
        await new.put(k("a"), Thing("a", 2), new_fence)

        with pytest.raises(LeadershipLost):
            await old.put(k("a"), Thing("a", 3), old_fence)
        assert old.get(k("a")) == Thing("a", 2)  # the copy mirrors etcd again
        with pytest.raises(LeadershipLost):  # even where the copy was right about the key
            await old.put(k("a"), Thing("a", 3), old_fence)
        with pytest.raises(LeadershipLost):
            await old.create(k("b"), Thing("b", 1), old_fence)
        assert old.get(k("b")) is None
        assert await stored(store, k("a")) == Thing("a", 2) and await stored(store, k("b")) is None

    run(backend, scenario)


def test_a_change_behind_the_copy_is_a_write_conflict_and_the_key_is_re_read(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        fence = await lead(store)
        first, second = cache(store), cache(store)
        await first.load()
        await second.load()

        await first.put(k("a"), Thing("a", 1), fence)
        with pytest.raises(WriteConflict, match=k("a")):
            await second.put(k("a"), Thing("a", 2), fence)  # decided without knowing of the first write
        assert second.get(k("a")) == Thing("a", 1) and await stored(store, k("a")) == Thing("a", 1)
        await second.put(k("a"), Thing("a", 3), fence)  # decided again from the re-read copy
        assert await stored(store, k("a")) == Thing("a", 3)

        assert await first.create(k("b"), Thing("b", 1), fence)
        with pytest.raises(WriteConflict):
            await second.create(k("b"), Thing("b", 2), fence)
        assert second.get(k("b")) == Thing("b", 1)
        assert not await second.create(k("b"), Thing("b", 2), fence)

    run(backend, scenario)


def test_a_key_deleted_behind_the_copy_is_a_write_conflict_and_dropped_from_the_copy(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        fence = await lead(store)
        things = cache(store)
        await things.load()
        await things.put(k("a"), Thing("a", 1), fence)
        assert await store.delete(k("a"))
        with pytest.raises(WriteConflict):
            await things.put(k("a"), Thing("a", 2), fence)
        assert things.get(k("a")) is None and things.values() == []
        await things.put(k("a"), Thing("a", 3), fence)  # created again
        assert await stored(store, k("a")) == Thing("a", 3)

    run(backend, scenario)


def test_a_key_outside_the_prefix_is_refused_before_any_write(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        fence = await lead(store)
        things = cache(store)
        revision = await store_revision(store)
        with pytest.raises(ValueError, match="not under"):
            await things.put(ROOT + "other", Thing("x", 1), fence)
        assert await store_revision(store) == revision

    run(backend, scenario)


def test_a_delete_leaves_memory_and_etcd_and_a_stale_copy_refuses_it(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        fence = await lead(store)
        things = cache(store)
        await things.put(k("a"), Thing("a", 1), fence)
        await things.put(k("b"), Thing("b", 2), fence)
        assert await things.delete(k("a"), fence)
        assert things.get(k("a")) is None and await stored(store, k("a")) is None
        assert not await things.delete(k("a"), fence)  # the copy has none: nothing to delete

        kv = await store.get(k("b"))  # changed behind the copy
        await store.compare_and_swap(k("b"), codec.encode(Thing("b", 3).to_json()), kv.mod_revision)
        with pytest.raises(WriteConflict):
            await things.delete(k("b"), fence)
        assert things.get(k("b")) == Thing("b", 3) == await stored(store, k("b"))

        other = await lead(store, "b")
        with pytest.raises(LeadershipLost):
            await things.delete(k("b"), fence)
        assert await things.delete(k("b"), other)

    run(backend, scenario)
