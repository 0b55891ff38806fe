"""Admission of Hellos: bounded at once, the rest queued, and deferred with a hint when the queue is long."""

import asyncio

import pytest

from common.clock import FakeClock
from daemon.admission import MIN_RETRY_AFTER_S, HelloAdmission, HelloDeferred


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
