"""The journal: every state written and read back; bad files refused; recovery in the core."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from controller.core import Core, Dial, DialDone, PulseReceived, TaskState, WorkerState
from controller.job_states import JobState
from controller.jobs import (
    Attempt,
    Job,
    history_from_json,
    history_to_json,
    notes_of,
    udp_job_id,
)
from controller.journal import SCHEMA_VERSION, Journal
from controller.journal_file import WORKER_ID_BLOCK, JournalError
from controller.shell import committer as committer_module
from controller.shell.committer import Committer
from controller.shell.durability import (
    BATCH_AFTER,
    BATCH_DELAY_MAX,
    BATCH_DELAY_PER_JOB,
    batch_delay,
)
from controller.usage import Usage, usage_from_text
from gen import worker_protocol_pb2 as pb
from tests.helpers import wait_until


def add(journal: Journal, ref: int, host: str, port: int, task_id: int, payload: bytes) -> None:
    job = Job(udp_job_id(host, port, task_id), ref, task_id, "udp", (host, port), payload)
    journal.job_added(job)


def finish(journal: Journal, ref: int, state: str, result: bytes, error: str) -> None:
    job = Job("", ref, 0, "udp", None)
    job.final = JobState.FINISHED if state == "success" else JobState.FAILED
    job.result, job.error, job.failed_post = result, error, state == "failed_post"
    journal.job_finished(job)


def commit(journal: Journal) -> None:
    batch, generation = journal.take()
    journal.write(batch)
    journal.committed_through(generation)


def test_every_state_round_trips(tmp_path):
    path = tmp_path / "j" / "journal.sqlite3"
    journal = Journal.open(path)
    assert journal.load().jobs == []
    add(journal, 1, "127.0.0.1", 4000, 5, b"queued payload")
    add(journal, 2, "::1", 4001, 6, b"running payload")
    journal.job_progress(2, "working", 2, (7, 9))
    add(journal, 3, "127.0.0.1", 4000, 7, b"x")
    finish(journal, 3, "success", b"\x00result", "")
    add(journal, 4, "127.0.0.1", 4000, 8, b"x")
    finish(journal, 4, "error", b"", "boom")
    journal.job_delivered(4, 3600)
    add(journal, 5, "127.0.0.1", 4000, 9, b"x")
    finish(journal, 5, "failed_post", b"", "no worker")
    add(journal, 6, "127.0.0.1", 4000, 10, b"x")
    journal.job_forgotten(6)
    commit(journal)
    journal.close()

    again = Journal.open(path)
    rows = {row.ref: row for row in again.load().jobs}
    assert sorted(rows) == [1, 2, 3, 4, 5]
    assert (rows[1].id, rows[1].door) == ("udp-127.0.0.1-4000-5", "udp")
    assert (rows[1].state, rows[1].payload, rows[1].host, rows[1].port) == (
        "pending",
        b"queued payload",
        "127.0.0.1",
        4000,
    )
    assert (rows[2].state, rows[2].attempts, rows[2].failed_on) == ("working", 2, [7, 9])
    assert (rows[3].state, rows[3].result, rows[3].notified, rows[3].payload) == (
        "finished",
        b"\x00result",
        False,
        b"",
    )
    assert (rows[4].state, rows[4].error, rows[4].notified) == ("failed", "boom", True)
    assert rows[4].expires_at is not None
    assert (rows[5].state, rows[5].error, rows[5].failed_post) == ("failed", "no worker", True)
    assert not rows[4].failed_post


def life_of_jobs(journal: Journal, between=lambda: None) -> None:
    """Jobs through every change, `between()` after each step."""
    add(journal, 1, "h", 1, 1, b"p1")
    between()
    journal.job_progress(1, "working", 1, ())
    add(journal, 2, "h", 1, 2, b"p2")
    between()
    journal.job_progress(1, "pending", 1, (3,))  # its worker failed: queued again
    journal.job_progress(2, "working", 1, ())
    between()
    journal.job_progress(1, "working", 2, (3,))
    finish(journal, 2, "success", b"r2", "")
    between()
    finish(journal, 1, "error", b"", "boom")
    journal.job_delivered(2, 3600)
    between()


def comparable_rows(path: Path) -> dict[int, tuple[object, ...]]:
    """The jobs on disk, but for their wall-clock times (which differ between two runs)."""
    return {
        r.ref: (r.state, r.attempts, r.failed_on, r.payload, r.result, r.error, r.notified)
        for r in Journal.open(path).load().jobs
    }


def written_at_once_and_step_by_step(
    tmp_path: Path,
    start: Callable[[Path], Journal],
    life: Callable[..., None],
    statements: int,
) -> dict[int, tuple[object, ...]]:
    """`life(journal, between=...)` on two journals set up by `start`: in one batch, which
    must hold `statements` statements, and with a commit after each step. Both must leave
    the same rows; those rows."""
    one = start(tmp_path / "one.sqlite3")
    life(one)
    batch, _ = one.take()
    assert len(batch) == statements
    one.write(batch)
    one.close()

    steps = start(tmp_path / "steps.sqlite3")
    life(steps, between=lambda: commit(steps))
    commit(steps)
    steps.close()

    rows = comparable_rows(tmp_path / "one.sqlite3")
    assert rows == comparable_rows(tmp_path / "steps.sqlite3")
    return rows


def fresh(path: Path) -> Journal:
    journal = Journal.open(path)
    journal.load()
    return journal


# How life_of_jobs and later_life leave their two jobs.
LIFE_OUTCOME = {
    # A failed job keeps its payload (a user may retry it); a finished one drops it.
    1: ("failed", 0, [3], b"p1", b"", "boom", False),  # finish() says 0 attempts
    2: ("finished", 0, [], b"", b"r2", "", True),
}


def test_changes_to_a_job_added_in_the_same_batch_are_one_row_written_the_same(tmp_path):
    # Each job's changes folded into its insert; the delivery an UPDATE after it.
    rows = written_at_once_and_step_by_step(tmp_path, fresh, life_of_jobs, statements=3)
    assert rows == LIFE_OUTCOME


def test_a_job_started_and_finished_in_one_batch_is_one_update_written_the_same(tmp_path):
    """Under load a short job's start and finish share a batch after the one that added it."""

    def two_jobs_committed(path: Path) -> Journal:
        journal = fresh(path)
        add(journal, 1, "h", 1, 1, b"p1")
        add(journal, 2, "h", 1, 2, b"p2")
        commit(journal)
        return journal

    def later_life(journal: Journal, between: Callable[[], None] = lambda: None) -> None:
        journal.job_progress(1, "working", 1, ())
        between()
        journal.job_progress(1, "pending", 1, (3,))  # its worker failed: queued again
        journal.job_progress(2, "working", 1, ())
        journal.job_progress(1, "working", 2, (3,))
        between()
        finish(journal, 2, "success", b"r2", "")
        finish(journal, 1, "error", b"", "boom")
        between()
        journal.job_delivered(2, 3600)

    # One UPDATE per job, then the delivery.
    rows = written_at_once_and_step_by_step(tmp_path, two_jobs_committed, later_life, statements=3)
    assert rows == LIFE_OUTCOME


def test_next_ref_and_worker_ids_continue(tmp_path):
    path = tmp_path / "journal.sqlite3"
    journal = Journal.open(path)
    first = journal.load()
    assert first.first_worker_id == 1
    add(journal, 41, "h", 1, 1, b"")
    commit(journal)
    journal.close()
    second = Journal.open(path).load()
    assert second.next_ref == 42
    assert second.first_worker_id == 1 + WORKER_ID_BLOCK  # the whole reserved block is skipped


def test_worker_id_blocks_are_reserved_ahead(tmp_path):
    journal = Journal.open(tmp_path / "journal.sqlite3")
    journal.load()
    assert journal.worker_id_durable(WORKER_ID_BLOCK) and not journal.worker_id_durable(
        WORKER_ID_BLOCK + 1
    )
    journal.reserve_worker_ids(WORKER_ID_BLOCK // 2 + 1)
    assert journal.dirty and not journal.worker_id_durable(WORKER_ID_BLOCK + 1)
    commit(journal)
    assert journal.worker_id_durable(WORKER_ID_BLOCK + 1)


def test_expired_records_pruned_at_start(tmp_path):
    path = tmp_path / "journal.sqlite3"
    journal = Journal.open(path)
    journal.load()
    for ref in range(1, 2501):
        add(journal, ref, "h", 1, ref, b"")
        finish(journal, ref, "success", b"r", "")
        journal.job_delivered(ref, -1.0)  # retention already over
    commit(journal)
    journal.close()
    recovered = Journal.open(path).load()
    assert recovered.pruned == 2500 and recovered.jobs == []


def test_generations_tell_what_is_on_disk(tmp_path):
    journal = Journal.open(tmp_path / "journal.sqlite3")
    journal.load()
    assert journal.latest_generation() == 0 == journal.committed
    add(journal, 1, "h", 1, 1, b"")
    assert journal.latest_generation() == 1 > journal.committed
    batch, generation = journal.take()
    add(journal, 2, "h", 1, 2, b"")
    assert journal.latest_generation() == 2
    journal.write(batch)
    journal.committed_through(generation)
    assert journal.committed == 1 < journal.latest_generation()


@pytest.mark.parametrize("kind", ["garbage", "foreign"])
def test_corrupt_or_foreign_file_refused(tmp_path, kind):
    path = tmp_path / "journal.sqlite3"
    if kind == "garbage":
        path.write_bytes(b"this is not a database at all" * 200)
    else:
        db = sqlite3.connect(path)
        db.execute("CREATE TABLE customers (name TEXT)")
        db.commit()
        db.close()
    with pytest.raises(JournalError) as info:
        Journal.open(path)
    assert str(path) in str(info.value)
    if kind == "foreign":
        assert "not a controller journal" in str(info.value)
        assert sqlite3.connect(path).execute("SELECT name FROM sqlite_master").fetchall() == [
            ("customers",)
        ]


def test_unwritable_directory_refused(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the directory should be")
    with pytest.raises(JournalError, match="cannot create its directory"):
        Journal.open(blocker / "journal.sqlite3")


def test_read_only_location_refused():
    with pytest.raises(JournalError, match=re.escape("/proc/journal.sqlite3")):
        Journal.open(Path("/proc/journal.sqlite3"))


# ---------------------------------------------------------------- recovery in the core


def register_with_task(core: Core, task_id: int, now: float, fetch_me: bool = False):
    reply = core.handle(
        PulseReceived(pb.WorkerPulse(type=pb.PULSE_REGISTER, next_pulse=2), None, 1000), now
    )
    wid = reply[0].response.worker_id
    ptype = pb.PULSE_FETCH_ME if fetch_me else pb.PULSE_OK
    actions = core.handle(
        PulseReceived(
            pb.WorkerPulse(type=ptype, worker_id=wid, task_id=task_id, next_pulse=2), None, 1000
        ),
        now,
    )
    return wid, actions


def test_running_task_adopted_without_running_again():
    core = Core()
    core.recover(7, 5, b"p", "client", 0.0, running=True, attempts=1)
    wid, actions = register_with_task(core, 5, 0.5, fetch_me=True)
    dials = [a for a in actions if isinstance(a, Dial)]
    assert [d.kind for d in dials] == [pb.CTRL_FETCH]  # no SET_TASK, no RESTART
    assert core.workers[wid].state is WorkerState.FETCHING
    done = core.handle(DialDone(wid, pb.CTRL_FETCH, pb.WorkerResponse(task_id=5), b"r"), 0.6)
    [finished] = [a for a in done if hasattr(a, "result")]
    assert (finished.ref, finished.result, finished.job) == (7, b"r", "client")


def test_unclaimed_running_task_replaced_after_grace_both_sides():
    core = Core()
    core.recover(7, 5, b"p", None, 0.0, running=True, grace=3.0)
    assert core.task_state(7) is TaskState.ORPHAN
    core.expire(2.999)
    assert core.task_state(7) is TaskState.ORPHAN
    core.expire(3.0)
    assert core.task_state(7) is TaskState.QUEUED


def test_ambiguous_task_ids_are_not_guessed():
    core = Core()
    core.recover(7, 5, b"a", "one", 0.0, running=True)
    core.recover(8, 5, b"b", "two", 0.0, running=True)
    _, actions = register_with_task(core, 5, 0.5)
    assert [a.kind for a in actions if isinstance(a, Dial)] == [pb.CTRL_GET_STATUS]
    assert core.task_state(7) is TaskState.ORPHAN and core.task_state(8) is TaskState.ORPHAN


def test_queued_task_keeps_remaining_placement_time():
    core = Core(timeout_task_placement=30)
    core.recover(7, 5, b"p", None, 100.0, running=False, placement_left=4.0)
    assert core.queued == 1
    assert core.expire(103.999) == []
    [finished] = core.expire(104.0)
    assert finished.state is TaskState.FAILED_POST


def test_recovered_queued_task_claimed_by_worker_that_reports_it():
    core = Core()
    core.recover(7, 5, b"p", "client", 0.0, running=False)
    wid, actions = register_with_task(core, 5, 0.5)
    assert [a for a in actions if isinstance(a, Dial)] == []
    assert core.task_state(7) is TaskState.RUNNING and core.queued == 0
    assert core.workers[wid].state is WorkerState.BUSY


def test_version_1_journal_is_upgraded_in_place(tmp_path):
    """A journal written before jobs had ids and doors keeps every task, in the new words."""
    path = tmp_path / "journal.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
        CREATE TABLE tasks (ref INTEGER PRIMARY KEY, host TEXT NOT NULL, port INTEGER NOT NULL,
            task_id INTEGER NOT NULL, payload BLOB NOT NULL, state TEXT NOT NULL,
            attempts INTEGER NOT NULL DEFAULT 0, failed_on TEXT NOT NULL DEFAULT '[]',
            queued_at REAL NOT NULL, result BLOB, error TEXT,
            notified INTEGER NOT NULL DEFAULT 0, expires_at REAL);
        INSERT INTO tasks (ref, host, port, task_id, payload, state, queued_at)
            VALUES (1, '127.0.0.1', 4000, 5, x'61', 'queued', 100.0),
                   (2, '::1', 4001, 6, x'', 'running', 100.0),
                   (3, '127.0.0.1', 4000, 7, x'', 'success', 100.0),
                   (4, '127.0.0.1', 4000, 8, x'', 'failed_post', 100.0);
        PRAGMA application_id = 1245926476;
        PRAGMA user_version = 1;
        """
    )
    db.close()
    rows = {row.ref: row for row in Journal.open(path).load().jobs}
    assert [(r.id, r.door, r.state, r.failed_post) for r in rows.values()] == [
        ("udp-127.0.0.1-4000-5", "udp", "pending", False),
        ("udp-::1-4001-6", "udp", "working", False),
        ("udp-127.0.0.1-4000-7", "udp", "finished", False),
        ("udp-127.0.0.1-4000-8", "udp", "failed", True),
    ]
    assert rows[1].payload == b"a" and rows[1].added_at == 100.0
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


async def test_picked_task_ids_continue_after_a_restart(sockdir, tmp_path):
    """HTTP jobs get wire numbers the controller picks; after a restart they must not repeat
    a recovered live job's number."""
    from controller.app import assemble
    from controller.config import Config
    from controller.shell.recovery import recover

    path = tmp_path / "j.sqlite3"
    first = Journal.open(path)
    first.load()
    ctl = assemble(Config(socket_dir=sockdir, journal=path), first)
    _, desk, _ = ctl.shell, ctl.desk, ctl.udp
    job = Job("http-1", 1, desk.book.pick_task_id(), "http", None, b"")
    first.job_added(job)
    commit(first)
    first.close()
    again = Journal.open(path)
    recovered = again.load()
    ctl = assemble(Config(socket_dir=sockdir, journal=path), again)
    _, desk, _ = ctl.shell, ctl.desk, ctl.udp
    import trio

    recover(desk, recovered, trio.current_time())
    assert desk.book.pick_task_id() == job.task_id + 1
    again.close()


# ---------------------------------------------------------------- the committer's delay


def rows_on_disk(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute("SELECT count(*) FROM jobs").fetchone()[0])


async def started_committer(
    tmp_path: Path, nursery: trio.Nursery, in_flight: int
) -> tuple[Journal, Committer, list[float]]:
    """A committer on a fresh journal with `in_flight` jobs queued or running; the times of
    its commits."""
    journal = Journal.open(tmp_path / "journal.sqlite3")
    journal.load()
    commits: list[float] = []
    committer = Committer(
        journal, lambda: commits.append(trio.current_time()), in_flight=lambda: in_flight
    )
    await nursery.start(committer.run)
    return journal, committer, commits


def test_batches_wait_only_beyond_a_few_jobs_in_flight_and_not_long():
    assert [batch_delay(n) for n in range(BATCH_AFTER + 1)] == [0.0] * (BATCH_AFTER + 1)
    assert batch_delay(BATCH_AFTER + 3) == pytest.approx(3 * BATCH_DELAY_PER_JOB)
    assert batch_delay(10**6) == BATCH_DELAY_MAX


async def test_a_lone_jobs_change_is_committed_at_once(tmp_path, nursery, autojump_clock):
    journal, committer, commits = await started_committer(tmp_path, nursery, in_flight=1)
    start = trio.current_time()
    add(journal, 1, "h", 1, 1, b"")
    await committer.wait_for(journal.latest_generation())
    assert commits == [start]


async def test_with_other_jobs_in_flight_a_commit_waits_and_carries_what_comes_meanwhile(
    tmp_path, nursery, autojump_clock
):
    journal, committer, commits = await started_committer(tmp_path, nursery, in_flight=11)
    delay = batch_delay(11)
    start = trio.current_time()
    add(journal, 1, "h", 1, 1, b"")
    await trio.sleep(delay / 2)
    add(journal, 2, "h", 1, 2, b"")
    await committer.wait_for(journal.latest_generation())
    assert commits == [pytest.approx(start + delay)]  # one commit, for both
    assert rows_on_disk(tmp_path / "journal.sqlite3") == 2


async def test_the_commit_delay_is_bounded(tmp_path, nursery, autojump_clock):
    journal, committer, commits = await started_committer(tmp_path, nursery, in_flight=10**6)
    start = trio.current_time()
    add(journal, 1, "h", 1, 1, b"")
    await committer.wait_for(journal.latest_generation())
    assert commits == [pytest.approx(start + BATCH_DELAY_MAX)]


async def test_changes_waiting_out_the_delay_are_written_when_the_committer_stops(
    tmp_path, autojump_clock
):
    async with trio.open_nursery() as nursery:
        journal, _, commits = await started_committer(tmp_path, nursery, in_flight=10**6)
        add(journal, 1, "h", 1, 1, b"")
        await trio.sleep(BATCH_DELAY_MAX / 2)
        nursery.cancel_scope.cancel()  # e.g. SIGTERM in the middle of the delay
    assert commits == [] and journal.committed == journal.latest_generation()
    assert rows_on_disk(tmp_path / "journal.sqlite3") == 1


async def test_a_batch_that_fails_is_kept_and_written_once_the_journal_can_be(
    tmp_path, nursery, caplog, monkeypatch
):
    """A statement that fails (here the table is taken away by another connection) is
    rolled back, refused loudly, and its batch written with the next change once the
    table is back. (The real clock: a thread's commit is time the autojump clock would
    skip.)"""
    monkeypatch.setattr(committer_module, "RETRY_INTERVAL", 0.02)
    journal, committer, _ = await started_committer(tmp_path, nursery, in_flight=1)
    path = tmp_path / "journal.sqlite3"
    with sqlite3.connect(path) as other:
        other.execute("ALTER TABLE jobs RENAME TO elsewhere")
    add(journal, 1, "h", 1, 1, b"first")
    await wait_until(lambda: bool(journal.failing), timeout=5)
    assert "no such table: jobs" in journal.refusal_reason()
    assert "JOURNAL WRITE FAILED" in caplog.text
    add(journal, 2, "h", 1, 2, b"second")
    with sqlite3.connect(path) as other:
        other.execute("ALTER TABLE elsewhere RENAME TO jobs")
    with trio.fail_after(5):
        await committer.wait_for(journal.latest_generation())
    assert not journal.failing
    assert rows_on_disk(path) == 2


def test_a_change_whose_values_cannot_be_stored_fails_alone_and_the_rest_is_written(tmp_path):
    journal = Journal.open(tmp_path / "journal.sqlite3")
    journal.load()
    for ref in range(1, 600):
        add(journal, ref, "h", 1, ref, b"")
    batch, _ = journal.take()
    sql, params = batch[500]
    batch[500] = (sql, (*params[:-1], object()))  # a value SQLite cannot bind
    sql, params = batch[100]
    batch[100] = (sql, (*params[:5], 2**63, *params[6:]))  # a task_id over 64 bits
    rejected = journal.write(batch)
    assert [(change.ref, change.added) for change in rejected] == [(101, True), (501, True)]
    assert "OverflowError" in rejected[0].reason
    assert not journal._connection().in_transaction
    assert rows_on_disk(tmp_path / "journal.sqlite3") == 597


def test_a_statement_failing_on_the_file_rolls_back_the_whole_batch(tmp_path):
    path = tmp_path / "journal.sqlite3"
    journal = Journal.open(path)
    journal.load()
    for ref in range(1, 600):
        add(journal, ref, "h", 1, ref, b"")
    batch, _ = journal.take()
    batch.insert(500, ("UPDATE nowhere SET x = 1", ()))  # no such table: not a value's fault
    with pytest.raises(sqlite3.OperationalError):
        journal.write(batch)
    assert not journal._connection().in_transaction
    assert rows_on_disk(path) == 0
    journal.write(batch[:10])  # and the connection is usable again
    assert rows_on_disk(path) == 10


def test_a_new_journal_and_its_side_files_are_readable_by_their_owner_alone(tmp_path):
    """Job payloads and results are for the controller's user only, whatever the umask."""
    path = tmp_path / "journal.sqlite3"
    old = os.umask(0o002)
    try:
        journal = Journal.open(path)
        add(journal, 1, "127.0.0.1", 9, 5, b"secret payload")
        commit(journal)
        files = [p for p in tmp_path.iterdir() if p.name.startswith("journal.sqlite3")]
        assert path in files
        for file in files:
            assert stat.S_IMODE(file.stat().st_mode) == 0o600, file
        journal.close()
    finally:
        os.umask(old)


def test_an_existing_journal_others_could_read_is_made_owner_only(tmp_path, caplog):
    path = tmp_path / "journal.sqlite3"
    journal = Journal.open(path)
    add(journal, 1, "127.0.0.1", 9, 5, b"secret payload")
    commit(journal)
    journal.close()
    path.chmod(0o644)
    journal = Journal.open(path)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert "readable by others" in caplog.text
    finally:
        journal.close()


def test_a_journal_path_that_is_no_regular_file_is_refused_and_left_as_it_was(tmp_path):
    """A device or a FIFO given as the journal (say /dev/null) is refused, its mode untouched:
    making it 0600 would break every other user of /dev/null."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o666)
    fifo.chmod(0o666)
    with pytest.raises(JournalError, match="not a regular file"):
        Journal.open(fifo)
    assert stat.S_IMODE(fifo.stat().st_mode) == 0o666


def test_a_side_file_that_is_a_link_is_not_followed(tmp_path):
    """When an old journal is made 0600, a -wal that is a symbolic link is left alone (and
    what it points to keeps its mode)."""
    path = tmp_path / "journal.sqlite3"
    journal = Journal.open(path)
    commit(journal)
    journal.close()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("x")
    elsewhere.chmod(0o644)
    wal = tmp_path / "journal.sqlite3-wal"
    wal.unlink(missing_ok=True)
    wal.symlink_to(elsewhere)
    path.chmod(0o644)
    with contextlib.suppress(JournalError):  # SQLite may refuse the odd -wal: not the point
        Journal.open(path).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o644


@pytest.mark.parametrize(("sync", "pragma"), [("full", 2), ("normal", 1)])
def test_journal_sync_sets_the_synchronous_pragma(tmp_path, sync, pragma):
    journal = Journal.open(tmp_path / "journal.sqlite3", sync)
    try:
        assert journal._connection().execute("PRAGMA synchronous").fetchone()[0] == pragma
    finally:
        journal.close()


def test_text_with_lone_surrogates_is_journaled_and_read_back_exactly(tmp_path):
    path = tmp_path / "journal.sqlite3"
    journal = Journal.open(path)
    journal.load()
    job = Job("id-\ud800", 1, 7, "http", None, b"p\xed\xa0\x80", notes_of("n\udfff\u00e9"))
    journal.job_added(job)
    job.final, job.error, job.result = JobState.FAILED, "boom \udc80", b""
    journal.write(journal.take()[0])
    journal.job_finished(job)
    assert journal.write(journal.take()[0]) == []
    journal.close()
    (row,) = Journal.open(path).load().jobs
    assert (row.id, row.name, row.error) == ("id-\ud800", "n\udfff\u00e9", "boom \udc80")


def test_links_and_log_lines_are_journaled_as_given(tmp_path):
    path = tmp_path / "journal.sqlite3"
    journal = Journal.open(path)
    journal.load()
    job = Job("with-notes", 1, 7, "http", None, b"", notes_of("n", "i\ud800", "d\udfff"))
    journal.job_added(job)
    journal.job_logged(1, ["first \udc00"])  # folded into the insert
    journal.write(journal.take()[0])
    journal.job_logged(1, ["first \udc00", "second"])
    assert journal.write(journal.take()[0]) == []
    journal.close()
    (row,) = Journal.open(path).load().jobs
    assert (row.info_url, row.download_url) == ("i\ud800", "d\udfff")
    assert row.log == ["first \udc00", "second"]


def test_version_2_journal_gains_links_and_log(tmp_path):
    path = tmp_path / "journal.sqlite3"
    journal = Journal.open(path)
    journal.load()
    add(journal, 1, "h", 1, 1, b"kept")
    commit(journal)
    journal.close()
    with sqlite3.connect(path) as db:
        for column in (
            "reason",
            "usage",
            "ran_on",
            "history",
            "base",
            "options",
            "log",
            "download_url",
            "info_url",
        ):
            db.execute(f"ALTER TABLE jobs DROP COLUMN {column}")
        db.execute("PRAGMA user_version = 2")
    (row,) = Journal.open(path).load().jobs
    assert (row.payload, row.info_url, row.log) == (b"kept", "", [])
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_version_3_journal_gains_options_and_its_jobs_take_the_configured_ones(tmp_path):
    path = tmp_path / "journal.sqlite3"
    journal = Journal.open(path)
    journal.load()
    add(journal, 1, "h", 1, 1, b"kept")
    commit(journal)
    journal.close()
    with sqlite3.connect(path) as db:
        for column in ("reason", "usage", "ran_on", "history", "base", "options"):
            db.execute(f"ALTER TABLE jobs DROP COLUMN {column}")
        db.execute("DROP TABLE paused")
        db.execute("PRAGMA user_version = 3")
    recovered = Journal.open(path).load()
    (row,) = recovered.jobs
    assert (row.payload, row.options, row.retried_at, recovered.paused) == (b"kept", "", 0, [])
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_journal_sync_defaults_to_full(tmp_path):
    journal = Journal.open(tmp_path / "journal.sqlite3")
    try:
        assert journal._connection().execute("PRAGMA synchronous").fetchone()[0] == 2
    finally:
        journal.close()


async def test_controller_opens_its_journal_with_the_configured_sync(tmp_path, monkeypatch):
    from controller import main as controller_main
    from controller.config import ClientAddress, Config

    class Opened(Exception):
        """Stops the controller once its journal is open: nothing else is under test."""

    opened: list[Journal] = []
    real_open = Journal.open

    def recording_open(path: Path, sync: str = "full") -> Journal:
        opened.append(real_open(path, sync))
        raise Opened

    monkeypatch.setattr(Journal, "open", recording_open)
    config = Config(
        socket_dir=tmp_path / "s",
        client_address=ClientAddress("127.0.0.1", 0),
        journal=tmp_path / "journal.sqlite3",
        journal_sync="normal",
    )
    with pytest.raises(Opened):
        await controller_main.run_controller(config, 0, [])
    [journal] = opened
    try:
        assert journal._connection().execute("PRAGMA synchronous").fetchone()[0] == 1
    finally:
        journal.close()


def test_output_is_appended_cut_to_the_newest_bytes_and_read_back(tmp_path):
    path = tmp_path / "journal.sqlite3"
    journal = Journal.open(path)
    add(journal, 1, "127.0.0.1", 4000, 5, b"x")
    add(journal, 2, "127.0.0.1", 4000, 6, b"x")
    journal.job_output(1, b"\x00one\n", 10)
    journal.job_output(1, b"\xfftwo\n", 10)  # one change with the first: same batch
    batch, generation = journal.take()
    assert len(batch) == 3  # two inserts and one output
    journal.write(batch)
    journal.committed_through(generation)
    journal.job_output(2, b"kept", 10)
    commit(journal)
    journal.job_output(1, b"three\n", 10)  # a later batch: appended in SQL, and cut there
    journal.job_output(2, b"0123456789abcdef", 10)  # over the limit alone: its tail
    commit(journal)
    rows = {row.ref: row for row in journal.load().jobs}
    assert rows[1].output == b"\x00one\n\xfftwo\nthree\n"[-10:]
    assert rows[2].output == b"6789abcdef"
    journal.job_deleted(2)
    journal.job_forgotten(1)
    commit(journal)
    journal.close()
    again = Journal.open(path)
    rows = {row.ref: row for row in again.load().jobs}
    assert list(rows) == [2] and rows[2].output == b""
    db = sqlite3.connect(path)
    assert db.execute("SELECT COUNT(*) FROM output").fetchone() == (0,)
    db.close()
    again.close()


def test_output_of_jobs_pruned_at_start_goes_with_them(tmp_path):
    path = tmp_path / "journal.sqlite3"
    journal = Journal.open(path)
    add(journal, 1, "127.0.0.1", 4000, 5, b"x")
    finish(journal, 1, "success", b"r", "")
    journal.job_output(1, b"said something\n", 100)
    journal.job_delivered(1, 0)  # expires at once
    commit(journal)
    journal.close()
    again = Journal.open(path)
    assert again.load().jobs == []
    db = sqlite3.connect(path)
    assert db.execute("SELECT COUNT(*) FROM output").fetchone() == (0,)
    db.close()
    again.close()


def test_a_version_4_journal_gains_the_output_table_without_a_new_version(tmp_path):
    path = tmp_path / "journal.sqlite3"
    journal = Journal.open(path)
    add(journal, 1, "127.0.0.1", 4000, 5, b"x")
    commit(journal)
    journal.close()
    db = sqlite3.connect(path)
    db.execute("DROP TABLE output")  # as a journal written before job output was
    db.commit()
    db.close()
    again = Journal.open(path)
    again.job_output(1, b"hello\n", 100)
    commit(again)
    [row] = again.load().jobs
    assert row.output == b"hello\n" and SCHEMA_VERSION >= 4
    again.close()


def _failed_with_usage(ref: int, usage: Usage, reason: str) -> Job:
    job = Job("", ref, 0, "udp", None)
    job.final, job.error, job.usage, job.reason = JobState.FAILED, "limit hit", usage, reason
    return job


@pytest.mark.parametrize("same_batch", [True, False, "started"])
def test_a_jobs_usage_and_reason_are_kept(tmp_path, same_batch):
    """What the last attempt used and why the job failed come back after a restart, whether
    the end was folded into the job's insert, into its start, or written on its own."""
    path = tmp_path / "journal.sqlite3"
    journal = Journal.open(path)
    journal.load()
    add(journal, 1, "h", 1, 1, b"p")
    if same_batch is not True:
        commit(journal)
    if same_batch == "started":
        journal.job_progress(1, "working", 1, ())
    usage = Usage(wall=1.5, cpu=0.25, max_rss=4 << 20, memory_peak=8 << 20)
    journal.job_finished(_failed_with_usage(1, usage, "limit"))
    commit(journal)
    journal.close()
    (row,) = Journal.open(path).load().jobs
    assert (row.state, row.reason) == ("failed", "limit")
    assert usage_from_text(row.usage) == usage


def test_ended_attempts_keep_their_usage_and_older_rows_read_without(tmp_path):
    usage = Usage(wall=2.0, cpu=1.0, max_rss=1024)
    history = [Attempt(3, 10.0, 12.0, "failed", "boom", usage), Attempt(4, 13.0, 14.0, "failed")]
    text = history_to_json(history, 1000.0)
    back = history_from_json(text, 1000.0)
    assert back is not None
    assert [(a.worker, a.usage) for a in back] == [(3, usage), (4, None)]
    older = json.dumps([[3, 1010.0, 1012.0, "failed", "boom"]])  # a version 4 journal's
    assert [a.usage for a in history_from_json(older, 1000.0) or []] == [None]


def test_a_version_4_journal_gains_usage_and_reason(tmp_path):
    path = tmp_path / "journal.sqlite3"
    journal = Journal.open(path)
    journal.load()
    add(journal, 1, "h", 1, 1, b"kept")
    commit(journal)
    journal.close()
    with sqlite3.connect(path) as db:
        for column in ("reason", "usage"):
            db.execute(f"ALTER TABLE jobs DROP COLUMN {column}")
        db.execute("PRAGMA user_version = 4")
    again = Journal.open(path)
    (row,) = again.load().jobs
    assert (row.payload, row.usage, row.reason) == (b"kept", "", "")
    again.job_finished(_failed_with_usage(1, Usage(1.0, 0.5, 100), "error"))
    commit(again)
    (row,) = again.load().jobs
    assert row.reason == "error" and usage_from_text(row.usage) == Usage(1.0, 0.5, 100)
    again.close()
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 5
