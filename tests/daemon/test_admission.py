"""Admission of Hellos: bounded at once, the rest queued, and deferred with a hint when the queue is long;
sessions being opened bounded, each agent turned away given a turn of its own."""

import asyncio

import pytest

from common.clock import FakeClock
from daemon.admission import MIN_RETRY_AFTER_S, HelloAdmission, HelloDeferred, OpeningGate
from proto.vocabulary import MAX_RETRY_AFTER_S


def test_at_most_concurrent_hellos_are_admitted_at_once_and_the_rest_wait_their_turn() -> None:
    asyncio.run(asyncio.wait_for(_test_at_most_concurrent_hellos_are_admitted_at_once_and_the_rest_wait_their_turn(), 30))


async def _test_at_most_concurrent_hellos_are_admitted_at_once_and_the_rest_wait_their_turn() -> None:
    admission = HelloAdmission(FakeClock(), concurrent=3, max_wait_s=60.0)
    release = asyncio.Event()
    inside, most_inside, admitted = 0, 0, 0

    async def hello() -> None:
        nonlocal inside, most_inside, admitted
        async with admission.admit():
            inside += 1
            most_inside = max(most_inside, inside)
            await release.wait()
            inside -= 1
            admitted += 1

    hellos = [asyncio.create_task(hello()) for _ in range(10)]
    await asyncio.sleep(0.01)
    assert (inside, admission.waiting) == (3, 7)
    release.set()
    await asyncio.gather(*hellos)
    assert (most_inside, admitted, admission.waiting) == (3, 10, 0)


def test_a_hello_is_deferred_with_a_hint_when_the_queue_would_take_longer_than_max_wait() -> None:
    asyncio.run(asyncio.wait_for(_test_a_hello_is_deferred_with_a_hint_when_the_queue_would_take_longer_than_max_wait(), 30))


async def _test_a_hello_is_deferred_with_a_hint_when_the_queue_would_take_longer_than_max_wait() -> None:
    clock = FakeClock()
    admission = HelloAdmission(clock, concurrent=2, max_wait_s=1.1)
    for _ in range(100):  # teach it that one admission takes 0.5 s
        async with admission.admit():
            clock.advance(0.5)
    release = asyncio.Event()

    async def hello() -> None:
        async with admission.admit():
            await release.wait()

    holders = [asyncio.create_task(hello()) for _ in range(2 + 4)]  # 2 inside, 4 waiting: 1 s to drain
    await asyncio.sleep(0.01)
    assert admission.waiting == 4
    assert admission.expected_wait_s() == pytest.approx(1.0, rel=0.01)
    holders.append(asyncio.create_task(hello()))  # still within max_wait_s: waits
    await asyncio.sleep(0.01)
    with pytest.raises(HelloDeferred) as deferred:
        async with admission.admit():
            pass
    assert deferred.value.retry_after_s == pytest.approx(admission.expected_wait_s())
    assert deferred.value.retry_after_s >= MIN_RETRY_AFTER_S
    release.set()
    await asyncio.gather(*holders)
    async with admission.admit():  # the queue drained: admitted again
        pass


def test_a_waiting_hello_that_is_cancelled_gives_its_place_back() -> None:
    asyncio.run(asyncio.wait_for(_test_a_waiting_hello_that_is_cancelled_gives_its_place_back(), 30))


async def _test_a_waiting_hello_that_is_cancelled_gives_its_place_back() -> None:
    admission = HelloAdmission(FakeClock(), concurrent=1, max_wait_s=60.0)
    release = asyncio.Event()

    async def hello() -> None:
        async with admission.admit():
            await release.wait()

    first = asyncio.create_task(hello())
    second = asyncio.create_task(hello())
    await asyncio.sleep(0.01)
    second.cancel()
    await asyncio.gather(second, return_exceptions=True)
    assert admission.waiting == 0
    release.set()
    await first
    async with admission.admit():
        pass


async def opening_gate(clock: FakeClock, max_opening: int, opening_s: float) -> OpeningGate:
    """A gate taught that opening a session takes `opening_s`."""
    gate = OpeningGate(clock, max_opening=max_opening)
    for _ in range(200):
        async with gate.opening_session():
            clock.advance(opening_s)
    return gate


async def take_places(gate: OpeningGate, places: int) -> tuple[list[asyncio.Task], asyncio.Event]:
    """`places` sessions being opened until the returned event is set."""
    release = asyncio.Event()

    async def opening() -> None:
        async with gate.opening_session():
            await release.wait()

    holders = [asyncio.create_task(opening()) for _ in range(places)]
    await asyncio.sleep(0.01)
    return holders, release


def test_past_max_opening_a_hello_is_turned_away_at_once_and_a_freed_place_admits_again() -> None:
    asyncio.run(asyncio.wait_for(_test_past_max_opening_a_hello_is_turned_away_at_once(), 30))


async def _test_past_max_opening_a_hello_is_turned_away_at_once() -> None:
    gate = OpeningGate(FakeClock(), max_opening=2)
    holders, release = await take_places(gate, 2)
    assert gate.opening == 2
    with pytest.raises(HelloDeferred):  # not queued: the agent's Welcome timer would run out in a queue
        async with gate.opening_session():
            pass
    release.set()
    await asyncio.gather(*holders)
    assert gate.opening == 0
    async with gate.opening_session():
        assert gate.opening == 1


def test_each_deferred_agent_gets_its_own_later_turn_one_welcome_apart() -> None:
    asyncio.run(asyncio.wait_for(_test_each_deferred_agent_gets_its_own_later_turn_one_welcome_apart(), 30))


async def _test_each_deferred_agent_gets_its_own_later_turn_one_welcome_apart() -> None:
    clock = FakeClock()
    gate = await opening_gate(clock, max_opening=2, opening_s=0.5)
    assert gate.welcome_rate() == pytest.approx(4.0, rel=0.01)  # 2 places, 0.5 s each
    holders, release = await take_places(gate, 2)

    async def ticket() -> float:
        with pytest.raises(HelloDeferred) as deferred:
            async with gate.opening_session():
                pass
        return deferred.value.retry_after_s

    # the first no sooner than the places now taken clear (0.5 s), then one Welcome-time (0.25 s) apart
    assert [await ticket() for _ in range(4)] == pytest.approx([0.75, 1.0, 1.25, 1.5], rel=0.01)
    clock.advance(1.0)  # tickets handed out stay handed out: the next comes after the last
    assert await ticket() == pytest.approx(0.75, rel=0.01)
    for _ in range(1000):
        last = await ticket()
    assert last == MAX_RETRY_AFTER_S  # never past what an agent honours
    release.set()
    await asyncio.gather(*holders)


def test_the_agents_at_the_door_are_the_turns_still_to_come() -> None:
    asyncio.run(asyncio.wait_for(_test_the_agents_at_the_door_are_the_turns_still_to_come(), 30))


async def _test_the_agents_at_the_door_are_the_turns_still_to_come() -> None:
    clock = FakeClock()
    gate = await opening_gate(clock, max_opening=1, opening_s=1.0)  # one Welcome a second
    assert gate.agents_at_the_door() == 0
    async with gate.opening_session():
        counts = []
        for _ in range(5):
            with pytest.raises(HelloDeferred):
                async with gate.opening_session():
                    pass
            counts.append(gate.agents_at_the_door())
    assert counts == [1, 2, 3, 4, 5]  # their turns at 2, 3, 4, 5 and 6 s, behind the one being opened
    clock.advance(3.0)
    assert gate.agents_at_the_door() == 3  # those at 4, 5 and 6 s
    clock.advance(10.0)
    assert gate.agents_at_the_door() == 0


def test_the_agents_at_the_door_stay_counted_when_the_coordinator_welcomes_faster() -> None:
    asyncio.run(asyncio.wait_for(_test_the_agents_at_the_door_stay_counted_when_the_coordinator_welcomes_faster(), 30))


async def _test_the_agents_at_the_door_stay_counted_when_the_coordinator_welcomes_faster() -> None:
    clock = FakeClock()
    gate = await opening_gate(clock, max_opening=1, opening_s=1.0)
    async with gate.opening_session():
        for _ in range(10):
            with pytest.raises(HelloDeferred):
                async with gate.opening_session():
                    pass
    assert gate.agents_at_the_door() == 10
    for _ in range(50):  # the loop catches up: sessions open a hundred times faster
        async with gate.opening_session():
            pass
    assert gate.welcome_rate() > 50
    # Still the ten turned away (the time their tickets span times the welcome rate would say hundreds:
    # a pace fitted to those would stay slower than the agents held need).
    assert gate.agents_at_the_door() == 10
