"""What only the etcd adapter has: streams that break and resume, endpoints that are down,
authentication. Always against a real etcd."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from contextlib import aclosing
from pathlib import Path

import grpc
import pytest
from aetcd import rpc

from daemon.etcd_process import EmbeddedEtcd
from daemon.leader import LeaderElection, LeaderRecord
from daemon.store.etcd import EtcdStore
from daemon.store.interface import StoreError, StoreUnavailable, WatchEvent, WatchEventKind
from tests.cluster_box.etcd_cluster import EtcdCluster, EtcdMember
from tests.harness import Processes
from tests.ports import free_port
from tests.store.test_contract import PREFIX, k, take
from tests.waiting import wait_until


def run(coro, timeout_s: float = 20) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout_s))


def test_a_watch_resumes_after_its_stream_breaks_without_losing_or_repeating_events(
        etcd_server: EmbeddedEtcd) -> None:
    async def scenario() -> None:
        store = await EtcdStore.connect([etcd_server.endpoint])
        try:
            _, start = await store.get_prefix(PREFIX)
            async with aclosing(store.watch_prefix(PREFIX, start + 1)) as events:
                written = [await store.compare_and_swap(k("a"), b"1", 0)]
                assert [ev.mod_revision for ev in await take(events, 1)] == written

                assert store.interrupt_watch_streams() == 1
                # Written while the stream is down: the watch must come back for them.
                written.append(await store.compare_and_swap(k("b"), b"1", 0))
                written.append(await store.compare_and_swap(k("a"), b"2", written[0]))
                assert [ev.mod_revision for ev in await take(events, 2)] == written[1:]

                assert store.interrupt_watch_streams() == 1  # and again, with nothing missed
                written.append(await store.compare_and_swap(k("c"), b"1", 0))
                assert [ev.mod_revision for ev in await take(events, 1)] == written[3:]
        finally:
            await store.close()

    run(scenario())


def test_etcd_down_fails_reads_fast_loses_leases_after_their_ttl_and_watches_resume_after(
        etcd_server: EmbeddedEtcd) -> None:
    async def scenario() -> None:
        store = await EtcdStore.connect([etcd_server.endpoint], timeout_s=2)
        try:
            lease = await store.grant_lease(2)
            _, start = await store.get_prefix(PREFIX)
            async with aclosing(store.watch_prefix(PREFIX, start + 1)) as events:
                before = await store.compare_and_swap(k("before"), b"1", 0)
                await take(events, 1)

                await etcd_server.stop()
                with pytest.raises(StoreUnavailable):
                    await store.get(k("before"))
                await asyncio.wait_for(lease.wait_lost(), 4)  # TTL 2 s, counted from a refresh
                assert not lease.alive

                await etcd_server.start()
                after = await _retry_while_unavailable(
                    lambda: store.compare_and_swap(k("after"), b"1", 0))
                assert await take(events, 1) == [WatchEvent(WatchEventKind.PUT, k("after"), b"1", after)]
                assert after > before
        finally:
            await store.close()

    run(scenario())


async def _retry_while_unavailable(write, timeout_s: float = 5):
    """What a caller of the store does while the channel reconnects after etcd came back."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            return await write()
        except StoreUnavailable:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


def test_connect_moves_past_an_endpoint_that_is_down(etcd_server: EmbeddedEtcd) -> None:
    async def scenario() -> None:
        store = await EtcdStore.connect([f"127.0.0.1:{free_port()}", f"http://{etcd_server.endpoint}"])
        try:
            assert await store.compare_and_swap(k("a"), b"1", 0) is not None
        finally:
            await store.close()

    run(scenario())


def test_connect_names_the_endpoints_when_none_answers() -> None:
    dead = f"127.0.0.1:{free_port()}"

    async def scenario() -> None:
        with pytest.raises(StoreUnavailable, match=dead):
            await EtcdStore.connect([dead], timeout_s=0.5)

    run(scenario())


async def _enable_auth(endpoint: str, password: str) -> None:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        auth = rpc.AuthStub(channel)
        await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=password), timeout=5)
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
        await auth.AuthEnable(rpc.AuthEnableRequest(), timeout=5)


def test_username_and_password_authenticate_every_call_and_stream(etcd_server: EmbeddedEtcd) -> None:
    async def scenario() -> None:
        await _enable_auth(etcd_server.endpoint, "s3cret")
        store = await EtcdStore.connect([etcd_server.endpoint], username="root", password="s3cret")
        try:
            _, start = await store.get_prefix(PREFIX)
            lease = await store.grant_lease(2)
            async with aclosing(store.watch_prefix(PREFIX, start + 1)) as events:
                written = await store.compare_and_swap(k("a"), b"1", 0, lease=lease)
                assert [ev.mod_revision for ev in await take(events, 1)] == [written]

            store._metadata = (("token", "expired.token"),)  # what etcd forgets after its TTL
            assert (await store.get(k("a"))).value == b"1"  # re-authenticated once, retried
        finally:
            await store.close()

        with pytest.raises(StoreError, match="authentication as 'root'"):
            await EtcdStore.connect([etcd_server.endpoint], username="root", password="wrong")
        anonymous = await EtcdStore.connect([etcd_server.endpoint])
        try:
            with pytest.raises(StoreError):
                await anonymous.get(k("a"))
        finally:
            await anonymous.close()

    run(scenario())


def test_connect_refuses_half_given_credentials() -> None:
    async def scenario() -> None:
        with pytest.raises(ValueError, match="both username and password"):
            await EtcdStore.connect(["127.0.0.1:1"], username="root")
        with pytest.raises(ValueError, match="both cert_file and key_file"):
            await EtcdStore.connect(["127.0.0.1:1"], cert_file="client.pem")

    run(scenario())


async def _lease_ttl_in_etcd(endpoint: str, lease_id: int) -> int:
    """The TTL etcd itself has left on `lease_id` (-1 once it expired), asked over a channel of our own."""
    async with grpc.aio.insecure_channel(endpoint) as channel:
        reply = await rpc.LeaseStub(channel).LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease_id), timeout=5)
    return reply.TTL


def test_a_lease_outlives_an_event_loop_blocked_for_longer_than_its_ttl(etcd_server: EmbeddedEtcd) -> None:
    """A coordinator whose loop is saturated (or stalled by a long pass) keeps its leader lease: the
    keepalive runs in a thread of its own, not behind the loop's work."""
    async def scenario() -> None:
        store = await EtcdStore.connect([etcd_server.endpoint])
        try:
            lease = await store.grant_lease(2)
            await store.compare_and_swap(k("leased"), b"1", 0, lease=lease)
            time.sleep(5)  # noqa: ASYNC251 - the loop is blocked for 2.5 TTLs: nothing on it runs
            await asyncio.sleep(0)
            assert lease.alive
            assert await _lease_ttl_in_etcd(etcd_server.endpoint, lease.id) > 0
            assert await store.get(k("leased")) is not None  # its key was not deleted by an expiry
        finally:
            await store.close()

    run(scenario())


def test_a_lease_revoked_behind_the_stores_back_is_reported_lost_within_a_refresh(
        etcd_server: EmbeddedEtcd) -> None:
    async def scenario() -> None:
        store = await EtcdStore.connect([etcd_server.endpoint])
        try:
            lease = await store.grant_lease(3)
            async with grpc.aio.insecure_channel(etcd_server.endpoint) as channel:
                await rpc.LeaseStub(channel).LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease.id), timeout=5)
            await asyncio.wait_for(lease.wait_lost(), 2)  # the next refresh (TTL/3) hears TTL <= 0
            assert not lease.alive
        finally:
            await store.close()

    run(scenario())


def _watch_streams(member: EtcdMember) -> int:
    """How many watch streams `member` serves, from its own metrics."""
    with urllib.request.urlopen(f"{member.client_url}/metrics", timeout=5) as response:
        text = response.read().decode()
    return int(float(re.search(r"^etcd_debugging_mvcc_watch_stream_total (\S+)$", text, re.M).group(1)))


def test_a_standby_whose_watch_is_on_a_member_that_stopped_answering_still_takes_over(tmp_path: Path) -> None:
    """A standby waits for the leader key's deletion on a watch. When the etcd member serving that watch
    froze (or its host lost its link, maybe the leader's own host), it sends no FIN: the watch goes quiet,
    and the standby would not see the dead leader's key expire. The channel's keepalive (a ping every
    10 s, 5 s for the answer: common/grpc_keepalive.py) ends the stream within 15 s; the watch re-opens
    on a live member from where it stopped, sees the deletion, and the standby leads. With gRPC's default
    ping timeout that took 70 s."""
    procs = Processes(tmp_path)
    cluster = EtcdCluster(tmp_path, procs, token="frozen-watch")
    frozen: list[EtcdMember] = []

    async def scenario() -> None:
        leader_store = await EtcdStore.connect(cluster.endpoints)
        standby_store = await EtcdStore.connect(cluster.endpoints)
        try:
            assert await LeaderElection(leader_store, LeaderRecord("a", "a:1"), 3).try_acquire() is not None
            standby = LeaderElection(standby_store, LeaderRecord("b", "b:1"), 3)
            campaign = asyncio.create_task(standby.campaign())
            watched = await asyncio.to_thread(
                wait_until, lambda: next((m for m in cluster.members if _watch_streams(m) == 1), None), 10,
                "the standby's watch of the leader key")
            if cluster.leader() is watched:
                cluster.move_leader()  # the others then need no election to expire the lease
            cluster.freeze(watched)
            frozen.append(watched)

            await leader_store.close()  # the leader is gone: its lease expires 3 s on
            taken = await asyncio.wait_for(campaign, 30)
            assert taken.record == LeaderRecord("b", "b:1")
            assert await standby.current() == LeaderRecord("b", "b:1")
        finally:
            await leader_store.close()
            await standby_store.close()

    try:
        cluster.start()
        run(scenario(), timeout_s=90)
    finally:
        for member in frozen:
            cluster.thaw(member)
        procs.cleanup()
