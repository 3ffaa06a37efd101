"""The one deadline heap: order, ties, due-ness at the boundary."""

import math

from controller.deadlines import Deadlines


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
