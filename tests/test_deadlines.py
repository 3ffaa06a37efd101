"""The one deadline heap: order, ties, due-ness at the boundary; the timer that serves it."""

import math

import pytest
import trio

from controller.deadlines import Deadlines
from controller.shell.timer import COALESCE, DeadlineTimer


def test_empty_heap_is_never_due() -> None:
    heap: Deadlines[str] = Deadlines()
    assert heap.next() == math.inf
    assert heap.peek() is None
    assert heap.pop_due(1e9) is None


def test_items_come_out_in_time_order_and_ties_in_push_order() -> None:
    heap: Deadlines[str] = Deadlines()
    for when, item in [(3.0, "c"), (1.0, "a1"), (2.0, "b"), (1.0, "a2")]:
        heap.push(when, item)
    assert heap.next() == 1.0 and heap.peek() == "a1"
    assert heap.pop_due(0.999) is None
    assert heap.pop_due(1.0) == (1.0, "a1")
    assert heap.pop_due(1.0) == (1.0, "a2")
    assert heap.pop_due(1.5) is None
    assert heap.pop() == "b"
    assert len(heap) == 1


# ---------------------------------------------------------------- DeadlineTimer (trio)


async def test_timer_fires_for_due_deadlines_at_most_once_per_coalesce(autojump_clock):
    """1,000 deadlines a millisecond apart (stale entries, as every job leaves): fired about
    once per COALESCE, each firing serving everything due by then, none more than COALESCE late."""
    heap = Deadlines[int]()
    start = trio.current_time() + 1.0
    for i in range(1000):
        heap.push(start + i * 0.001, i)
    lateness: list[float] = []
    firings = 0

    def fire(now: float) -> None:
        nonlocal firings
        firings += 1
        while (due := heap.pop_due(now)) is not None:
            lateness.append(now - due[0])

    timer = DeadlineTimer(heap.next, fire)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(timer.run)
        await trio.sleep(3.0)
        nursery.cancel_scope.cancel()
    assert len(lateness) == 1000
    assert max(lateness) <= COALESCE + 1e-9
    assert firings <= 1.0 / COALESCE + 2


async def test_timer_poked_for_an_earlier_deadline_fires_then(autojump_clock):
    heap = Deadlines[str]()
    heap.push(trio.current_time() + 60, "late")
    fired: list[float] = []
    timer = DeadlineTimer(heap.next, lambda now: fired.append(now) if heap.pop_due(now) else None)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(timer.run)
        await trio.sleep(1.0)
        early = trio.current_time() + 2.0
        heap.push(early, "early")
        timer.poke()
        await trio.sleep(5.0)
        assert fired == [pytest.approx(early)]
        nursery.cancel_scope.cancel()
