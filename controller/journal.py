"""The SQLite journal: what an acknowledged job needs to survive a controller crash.

How it works: the event loop *stages* changes (a job was added, started,
re-queued, finished, its outcome delivered, its record forgotten) in a
list, which costs a tuple append. A committer task swaps that list out and
writes it in one transaction from a thread (WAL, synchronous=FULL: one fsync
per batch), so a burst of a thousand datagrams costs one commit: group
commit. Every change carries the generation of the batch it is in; the job
desk's `WriteAhead` (controller/shell/durability.py) holds each answer that
announces a change until that generation is committed, so no client ever sees
an acknowledgement or an outcome that a crash could take back. Opening the
file and reading it back at start are journal_file.py's.

Times in the file are wall-clock seconds (they must outlive the process);
the rest of the controller runs on trio's clock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller import journal_sql as sql
from controller.jobs import Job
from controller.journal_file import (
    WORKER_ID_BLOCK,
    JournalError,
    Recovered,
    connect,
    read_back,
)
from controller.options import to_json
from controller.usage import usage_to_text

log = logging.getLogger("controller.journal")

SCHEMA_VERSION = sql.SCHEMA_VERSION

Op = tuple[str, tuple[Any, ...]]


def stored_text(text: str) -> str | bytes:
    """A text value as the journal stores it: as it is when it is UTF-8, else (it holds a lone
    surrogate, which JSON allows and UTF-8 does not) its bytes with each surrogate as three
    bytes (`surrogatepass`), stored as a BLOB that `read_text` turns back into that text."""
    if text.isascii():
        return text
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")
    return text


def _log_text(lines: list[str]) -> str:
    """A log as the journal stores it: a JSON list, ASCII (a lone surrogate as an escape)."""
    return json.dumps(lines) if lines else "[]"


class Journal:
    """Staging in the event loop, writing from one thread at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._sync = "FULL"  # the synchronous pragma (see open)
        self._db: sqlite3.Connection | None = None
        self._staged: list[Op] = []
        # Jobs added in the batch being staged, by ref: the index of their sql.INSERT, which a
        # later change in the same batch rewrites instead of adding an UPDATE.
        self._inserted: dict[int, int] = {}
        # Jobs whose last change in the batch is a sql.PROGRESS, by ref: its index, which a later
        # progress or finish rewrites.
        self._progressed: dict[int, int] = {}
        # Jobs whose output grew in the batch being staged, by ref: the index of its sql.OUTPUT,
        # which a later append in the same batch extends.
        self._outputs: dict[int, int] = {}
        self.generation = 1  # generation of the batch being staged
        self.committed = 0  # highest generation known to be on disk
        self.failing = ""  # why the last commit failed ("" while healthy)
        # Called when the first change of a batch is staged: the committer wakes up.
        self.on_dirty: Callable[[], None] = lambda: None
        self.ceiling = 0  # worker ids below this are reserved (staged or written)
        self.durable_ceiling = 0  # worker ids below this are reserved on disk
        self._ceiling_generation = 0

    # ------------------------------------------------------------ opening

    @classmethod
    def open(cls, path: Path, sync: str = "full") -> Journal:
        """Open or create the journal file; JournalError naming the path when unusable.

        `sync`: "full" fsyncs every commit (a committed change survives a power loss),
        "normal" leaves the WAL to the OS (it survives a crash of the process, not of the
        machine)."""
        journal = cls(path)
        journal._db = connect(path, "NORMAL" if sync == "normal" else "FULL")
        return journal

    def load(self, now_wall: float | None = None) -> Recovered:
        """Read back every task and reserve the next block of worker ids (committed now)."""
        out = read_back(self._connection(), self.path, now_wall)
        self.ceiling = self.durable_ceiling = out.first_worker_id + WORKER_ID_BLOCK
        return out

    def close(self) -> None:
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._db = None

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            raise JournalError(f"journal {self.path} is closed")
        return self._db

    # ------------------------------------------------------------ staging (event loop)

    @property
    def dirty(self) -> bool:
        """Changes staged and not yet handed to a commit."""
        return bool(self._staged)

    def _stage(self, op: Op) -> None:
        self._staged.append(op)
        if len(self._staged) == 1:
            self.on_dirty()

    def refusal_reason(self) -> str:
        """Why new jobs must be refused right now ("" when they are welcome)."""
        return self.failing

    def job_added(self, job: Job) -> None:
        host, port = job.key if isinstance(job.key, tuple) else ("", 0)
        wall = time.time()
        row = (
            job.ref,
            stored_text(job.id),
            job.door,
            host,
            port,
            job.task_id,
            stored_text(job.name),
            job.payload,
        )
        links = (stored_text(job.info_url), stored_text(job.download_url), _log_text(job.log))
        options = job.options
        run_at = options.run_at
        state, due = (
            ("pending", wall) if run_at is None or run_at <= wall else ("scheduled", run_at)
        )
        if job.task is None and options.after:  # it waits for others (the desk's waits.py)
            state = "waiting"
        kept = to_json(options)
        self._inserted[job.ref] = len(self._staged)
        self._stage(
            (
                sql.INSERT,
                (*row, state, 0, "[]", due, wall, None, None, False, *links, kept, 0, 0, "", ""),
            )
        )

    def job_progress(
        self,
        ref: int,
        state: str,
        attempts: int,
        failed_on: tuple[int, ...],
        due: float | None = None,
    ) -> None:
        """The job started, went back to the queue, or waits for its time (`state`
        scheduled, due at wall-clock `due`)."""
        failed = json.dumps(sorted(failed_on)) if failed_on else "[]"
        values = (state, attempts, failed, time.time() if due is None else due)
        if self._fold(ref, sql.PROGRESS_IN_INSERT, values):
            return
        index = self._progressed.get(ref)
        if index is None:
            self._progressed[ref] = len(self._staged)
            self._stage((sql.PROGRESS, (*values, ref)))
        else:
            self._staged[index] = (sql.PROGRESS, (*values, ref))

    def job_finished(self, job: Job) -> None:
        ref = job.ref
        error = stored_text(job.error)
        values = (
            job.state.value,
            job.attempts,
            job.result,
            error,
            job.failed_post,
            job.ran_on,
            usage_to_text(job.usage),
            job.reason,
        )
        keep = job.state.value != "finished"  # failed or canceled: it may be retried
        if keep:
            if self._fold(ref, sql.FINISH_IN_INSERT, values):
                return
        elif self._fold(ref, (sql.PAYLOAD_IN_INSERT, *sql.FINISH_IN_INSERT), (b"", *values)):
            return
        index = self._progressed.pop(ref, None)
        if index is None:
            self._stage((sql.FINISH_KEEP if keep else sql.FINISH, (*values, ref)))
            return
        _, (_, _, failed, queued_at, _) = self._staged[index]
        state, attempts, *outcome = values
        row = (state, attempts, failed, queued_at, *outcome, ref)
        self._staged[index] = (sql.PROGRESS_FINISH_KEEP if keep else sql.PROGRESS_FINISH, row)

    def job_retried(self, ref: int, attempts: int) -> None:
        """A user put the failed or canceled job back: pending, max_retries counted anew
        from its `attempts` so far (the column `base`)."""
        self._progressed.pop(ref, None)
        values = ("pending", attempts, None, None, False, "")
        if not self._fold(ref, sql.RETRIED_IN_INSERT, values):
            self._stage((sql.RETRIED, (attempts, time.time(), ref)))

    def queue_paused(self, queue: str, paused: bool) -> None:
        """A queue was paused or resumed."""
        self._stage((sql.PAUSED if paused else sql.RESUMED, (queue,)))

    def queue_limited(self, queue: str, concurrency: int | None, rate: str | None) -> None:
        """A queue's limits were set (both None: removed)."""
        if concurrency is None and rate is None:
            self._stage((sql.UNLIMITED, (queue,)))
        else:
            self._stage((sql.LIMITED, (concurrency, rate, queue)))

    def _fold(self, ref: int, positions: tuple[int, ...], values: tuple[Any, ...]) -> bool:
        """Write `values` at `positions` of the job's sql.INSERT when that is in the batch being
        staged (one row written instead of two or three); False when it is not."""
        index = self._inserted.get(ref)
        if index is None:
            return False
        statement, params = self._staged[index]
        row = list(params)
        for position, value in zip(positions, values, strict=True):
            row[position] = value
        self._staged[index] = (statement, tuple(row))
        return True

    def job_leased(self, ref: int, lease: str) -> None:
        """A poller claimed the job with this lease."""
        self._stage((sql.LEASED, (ref, lease)))

    def job_unleased(self, ref: int) -> None:
        """The job a poller held ended: its lease is of no more use."""
        self._stage((sql.UNLEASED, (ref,)))

    def job_history(self, ref: int, history: str) -> None:
        """An attempt of the job ended without ending it: its ended attempts are now
        `history` (JSON). (The worker of its latest attempt is written when it ends.)"""
        self._stage((sql.HISTORY, (history, ref)))

    def schedule_due(self, name: str, due: float) -> None:
        """Periodic job `name` is done with due time `due` (wall-clock seconds)."""
        self._stage((sql.SCHEDULED, (name, due)))

    def job_logged(self, ref: int, lines: list[str]) -> None:
        """The job's log is now `lines` (one was added, or old ones dropped)."""
        text = _log_text(lines)
        if not self._fold(ref, (sql.LOG_IN_INSERT,), (text,)):
            self._stage((sql.LOG, (text, ref)))

    def job_output(self, ref: int, data: bytes, retention: int) -> None:
        """`data` was appended to the job's output, of which the newest `retention` bytes are
        kept. Appends to one job within a batch go in as one."""
        if not data:
            return
        index = self._outputs.get(ref)
        if index is not None and index < len(self._staged):
            statement, (_, before, _) = self._staged[index]
            if statement == sql.OUTPUT:
                joined = before + data
                self._staged[index] = (sql.OUTPUT, (retention, joined[-retention:], ref))
                return
        self._outputs[ref] = len(self._staged)
        self._stage((sql.OUTPUT, (retention, data[-retention:], ref)))

    def job_delivered(self, ref: int, retention: float) -> None:
        self._stage((sql.NOTIFIED, (time.time() + retention, ref)))

    def job_deleted(self, ref: int) -> None:
        self._progressed.pop(ref, None)  # what comes after this must be written after it
        self._outputs.pop(ref, None)
        self._stage((sql.DELETED, (ref,)))
        self._stage((sql.DROP_OUTPUT, (ref,)))

    def job_forgotten(self, ref: int) -> None:
        self._progressed.pop(ref, None)
        self._outputs.pop(ref, None)
        self._stage((sql.FORGET, (ref,)))
        self._stage((sql.DROP_OUTPUT, (ref,)))

    def latest_generation(self) -> int:
        """The newest generation holding any change: what an outgoing datagram waits for."""
        return self.generation if self._staged else self.generation - 1

    def reserve_worker_ids(self, next_id: int) -> None:
        """Stage the next block of worker ids once `next_id` is half-way through this one."""
        if next_id + WORKER_ID_BLOCK // 2 >= self.ceiling:
            self.ceiling = next_id + WORKER_ID_BLOCK
            self._stage((sql.CEILING, (self.ceiling,)))
            self._ceiling_generation = self.generation

    def worker_id_durable(self, worker_id: int) -> bool:
        """True once a crash could no longer hand `worker_id` out again."""
        return worker_id < self.durable_ceiling

    def committed_through(self, generation: int) -> None:
        """The committer wrote every batch up to `generation`."""
        self.committed = generation
        if self._ceiling_generation and self._ceiling_generation <= generation:
            self.durable_ceiling = self.ceiling
            self._ceiling_generation = 0

    # ------------------------------------------------------------ committing (one thread)

    def take(self) -> tuple[list[Op], int]:
        """Hand the staged batch to a commit; staging continues in a new generation."""
        batch, self._staged = self._staged, []
        self._inserted = {}
        self._progressed = {}
        self._outputs = {}
        generation = self.generation
        self.generation += 1
        return batch, generation

    def restage(self, batch: list[Op]) -> None:
        """A commit failed: its changes go first into the next attempt. Whatever waited for
        them waits for that attempt's generation, which is higher."""
        self._staged[:0] = batch
        self._inserted = {}  # their places moved: later changes go in as UPDATEs
        self._progressed = {}
        self._outputs = {}

    def write(self, batch: list[Op]) -> list[Rejected]:
        """Run in a thread: apply one batch in one transaction; returns the changes refused.

        A change whose values SQLite cannot take (a bug upstream: a number out of range, text
        it cannot encode) must not hold its neighbours back for ever: the batch is then
        written again change by change, each in a savepoint, and the changes that fail alone
        are left out and returned. A failure of the disk or the file (sqlite3.OperationalError,
        sqlite3.DatabaseError) writes nothing and raises, as it would for every change.
        """
        db = self._connection()
        db.execute("BEGIN")
        try:
            for statement, params in batch:
                db.execute(statement, params)
            db.execute("COMMIT")
        except VALUE_ERRORS:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            return self._write_each(db, batch)
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise
        return []

    @staticmethod
    def _write_each(db: sqlite3.Connection, batch: list[Op]) -> list[Rejected]:
        rejected: list[Rejected] = []
        db.execute("BEGIN")
        try:
            for statement, params in batch:
                db.execute("SAVEPOINT change")
                try:
                    db.execute(statement, params)
                except VALUE_ERRORS as exc:
                    db.execute("ROLLBACK TO change")
                    rejected.append(_rejected(statement, params, exc))
                db.execute("RELEASE change")
            db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise
        return rejected


# What a change's values can fail with, as opposed to the disk or the file (OperationalError,
# DatabaseError): UnicodeEncodeError is a ValueError, an integer over 64 bits an OverflowError.
VALUE_ERRORS = (
    ValueError,
    TypeError,
    OverflowError,
    sqlite3.InterfaceError,
    sqlite3.ProgrammingError,
    sqlite3.IntegrityError,
    sqlite3.DataError,
)


@dataclass(frozen=True, slots=True)
class Rejected:
    """A change the journal could not store: the job it belongs to (ref 0: none) and why;
    `added`: it was the job's first record (the job is refused at its door)."""

    ref: int
    added: bool
    reason: str


def _rejected(statement: str, params: tuple[Any, ...], exc: Exception) -> Rejected:
    reason = f"{type(exc).__name__}: {exc}"[:300]
    if statement == sql.INSERT:
        return Rejected(params[0], True, reason)
    if statement == sql.CEILING:
        return Rejected(0, False, reason)
    ref = params[-1]
    return Rejected(ref if isinstance(ref, int) else 0, False, reason)
