"""The pending order (controller/core/pending.py): queues and labels filter, priority orders,
owners take turns, one owner's jobs in submission order. Properties over random workloads."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from controller.core.model import Task, Worker
from controller.core.pending import Pending
from controller.options import JobOptions

QUEUES = ["default", "q1", "q2"]
LABELS = ["gpu", "ssd"]

job = st.tuples(
    st.integers(0, 4),  # owner
    st.sampled_from(QUEUES),
    st.integers(-1, 1),  # priority
    st.frozensets(st.sampled_from(LABELS), max_size=2),  # requires
)
worker = st.tuples(
    st.frozensets(st.sampled_from(QUEUES), min_size=1),
    st.frozensets(st.sampled_from(LABELS)),
)


def make_task(ref: int, owner: int, queue: str, priority: int, requires: frozenset[str]) -> Task:
    task = Task(ref=ref, task_id=ref, payload=b"", job=None)
    task.opts = JobOptions(queue=queue, priority=priority, requires=requires, owner=f"o{owner}")
    return task


def make_worker(worker_id: int, queues: frozenset[str], labels: frozenset[str]) -> Worker:
    return Worker(worker_id, None, None, None, 0.0, queues=queues, labels=labels)


def fits(w: Worker, task: Task) -> bool:
    return task.opts.queue in w.queues and task.opts.requires <= w.labels


@settings(max_examples=300)
@given(st.lists(job, max_size=60), st.lists(st.tuples(worker, st.integers(1, 6)), max_size=30))
def test_a_worker_takes_the_right_task_or_none(jobs, turns):
    """Every pick: a task the worker may take, of the highest priority it may take, and the
    oldest of its owner at that priority; None only when it may take none."""
    pending = Pending()
    waiting: dict[int, Task] = {}
    for ref, (owner, queue, priority, requires) in enumerate(jobs, start=1):
        made = make_task(ref, owner, queue, priority, requires)
        pending.add(made)
        waiting[ref] = made
    for n, ((queues, labels), picks) in enumerate(turns):
        w = make_worker(n, queues, labels)
        for _ in range(picks):
            eligible = [t for t in waiting.values() if fits(w, t)]
            task = pending.pick(w)
            if task is None:
                assert eligible == []
                break
            assert fits(w, task)
            top = max(t.opts.priority for t in eligible)
            assert task.opts.priority == top
            same = [
                t for t in eligible if (t.opts.owner, t.opts.priority) == (task.opts.owner, top)
            ]
            assert task.ref == min(t.ref for t in same)
            del waiting[task.ref]
            assert len(pending) == len(waiting)
    assert sorted(t.ref for t in pending) == sorted(waiting)


@settings(max_examples=200)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 30)), min_size=1, max_size=6))
def test_owners_take_turns_so_none_waits_behind_another_owners_batch(batches):
    """Equal priority, a worker that takes everything: an owner with jobs pending is served
    within one round of the other owners, however many jobs they have."""
    pending = Pending()
    ref = 0
    for owner, count in batches:
        for _ in range(count):
            ref += 1
            pending.add(make_task(ref, owner, "default", 0, frozenset()))
    w = make_worker(1, frozenset({"default"}), frozenset())
    owners = {f"o{owner}" for owner, _ in batches}
    waited = dict.fromkeys(owners, 0)
    left = {name: 0 for name in owners}
    for queued in pending:
        left[queued.opts.owner] += 1
    while (task := pending.pick(w)) is not None:
        left[task.opts.owner] -= 1
        for name in owners:
            waited[name] = 0 if name == task.opts.owner else waited[name] + 1
            if left[name]:
                assert waited[name] < len(owners)
    assert not any(left.values())


def test_a_single_job_is_not_held_back_by_a_batch_of_100000():
    pending = Pending()
    for ref in range(1, 100_001):
        pending.add(make_task(ref, 1, "default", 0, frozenset()))
    pending.add(make_task(100_001, 2, "default", 0, frozenset()))
    w = make_worker(1, frozenset({"default"}), frozenset())
    first, second = pending.pick(w), pending.pick(w)
    assert first is not None and second is not None
    assert {first.ref, second.ref} == {1, 100_001}


def test_higher_priority_first_and_paused_queues_are_skipped_until_resumed():
    pending = Pending()
    pending.add(make_task(1, 1, "default", 0, frozenset()))
    pending.add(make_task(2, 1, "q1", 5, frozenset()))
    w = make_worker(1, frozenset({"default", "q1"}), frozenset())
    pending.pause("q1")
    version = pending.version
    got = pending.pick(w)
    assert got is not None and got.ref == 1
    assert pending.pick(w) is None
    pending.resume("q1")
    assert pending.version > version  # a worker that found nothing looks again
    got = pending.pick(w)
    assert got is not None and got.ref == 2


def test_a_job_that_requires_a_label_goes_only_to_a_worker_with_it():
    pending = Pending()
    pending.add(make_task(1, 1, "default", 0, frozenset({"gpu"})))
    plain = make_worker(1, frozenset({"default"}), frozenset({"ssd"}))
    gpu = make_worker(2, frozenset({"default"}), frozenset({"gpu", "ssd"}))
    assert pending.pick(plain) is None
    got = pending.pick(gpu)
    assert got is not None and got.ref == 1


def test_remove_takes_a_task_out_from_anywhere_and_counts_follow():
    pending = Pending()
    tasks = [make_task(ref, ref % 3, QUEUES[ref % 3], ref % 2, frozenset()) for ref in range(1, 31)]
    for task in tasks:
        pending.add(task)
    for task in tasks[::2]:
        pending.remove(task)
    assert len(pending) == 15
    assert sorted(t.ref for t in pending) == [t.ref for t in tasks[1::2]]
    for task in tasks[1::2]:
        pending.remove(task)
    assert (
        len(pending) == 0
        and list(pending) == []
        and pending.pick(make_worker(1, frozenset(QUEUES), frozenset())) is None
    )
