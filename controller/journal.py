"""The SQLite journal: what an acknowledged task needs to survive a controller crash.

How it works: the event loop *stages* changes (a task was added, started,
re-queued, finished, its outcome acknowledged, its record forgotten) in a
list, which costs a tuple append. A committer task swaps that list out and
writes it in one transaction from a thread (WAL, synchronous=FULL: one fsync
per batch), so a burst of a thousand datagrams costs one commit: group
commit. Every change carries the generation of the batch it is in; the UDP
shell holds each outgoing datagram until that generation is committed, so no
client ever sees an acknowledgement or an outcome that a crash could take back.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("controller.journal")

# "JCTL": marks the file as ours, so a foreign SQLite file is refused, not altered.
APPLICATION_ID = 0x4A43544C
SCHEMA_VERSION = 1
# Worker ids are reserved in blocks committed ahead of use, so that a crash can
# never hand out an id twice and no REGISTER waits for a commit.
WORKER_ID_BLOCK = 1000
# Rows removed per transaction when pruning expired records at start-up.
PRUNE_BATCH = 1000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS tasks (
    ref INTEGER PRIMARY KEY,
    host TEXT NOT NULL,
    port INTEGER NOT NULL,
    task_id INTEGER NOT NULL,
    payload BLOB NOT NULL,
    state TEXT NOT NULL,              -- queued, running, success, error, failed_post
    attempts INTEGER NOT NULL DEFAULT 0,
    failed_on TEXT NOT NULL DEFAULT '[]',
    queued_at REAL NOT NULL,          -- when it (re-)entered the queue
    result BLOB,
    error TEXT,
    notified INTEGER NOT NULL DEFAULT 0,  -- 1: the client acknowledged, or repeats ran out
    expires_at REAL                   -- when a finished record may be forgotten
);
"""

_INSERT = (
    "INSERT OR REPLACE INTO tasks (ref, host, port, task_id, payload, state, queued_at)"
    " VALUES (?, ?, ?, ?, ?, 'queued', ?)"
)
_PROGRESS = "UPDATE tasks SET state = ?, attempts = ?, failed_on = ?, queued_at = ? WHERE ref = ?"
_FINISH = (
    "UPDATE tasks SET state = ?, result = ?, error = ?, payload = x'', notified = 0,"
    " expires_at = NULL WHERE ref = ?"
)
_NOTIFIED = "UPDATE tasks SET notified = 1, expires_at = ? WHERE ref = ?"
_FORGET = "DELETE FROM tasks WHERE ref = ?"
_CEILING = "INSERT OR REPLACE INTO meta (key, value) VALUES ('worker_id_ceiling', ?)"


class JournalError(Exception):
    """The journal cannot be used; the message names the path (exit status 2 at start-up)."""


@dataclass
class TaskRow:
    ref: int
    host: str
    port: int
    task_id: int
    payload: bytes
    state: str
    attempts: int
    failed_on: list[int]
    queued_at: float
    result: bytes
    error: str
    notified: bool
    expires_at: float | None


@dataclass
class Recovered:
    tasks: list[TaskRow] = field(default_factory=list)
    first_worker_id: int = 1
    next_ref: int = 1
    pruned: int = 0


Op = tuple[str, tuple[Any, ...]]


class Journal:
    """Staging in the event loop, writing from one thread at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db: sqlite3.Connection | None = None
        self._staged: list[Op] = []
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
    def open(cls, path: Path) -> Journal:
        """Open or create the journal file; JournalError naming the path when unusable."""
        journal = cls(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise JournalError(
                f"journal {path}: cannot create its directory: {exc.strerror}"
            ) from None
        try:
            db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise JournalError(f"journal {path}: cannot open: {exc}") from None
        journal._db = db
        try:
            journal._prepare(db)
        except sqlite3.Error as exc:
            db.close()
            raise JournalError(f"journal {path}: not usable: {exc}") from None
        except JournalError:
            db.close()
            raise
        return journal

    def _prepare(self, db: sqlite3.Connection) -> None:
        app_id = db.execute("PRAGMA application_id").fetchone()[0]
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if app_id != APPLICATION_ID and (app_id != 0 or tables):
            raise JournalError(
                f"journal {self.path}: not a controller journal (application_id {app_id}, "
                f"tables {sorted(tables)}); refusing to touch it"
            )
        if db.execute("PRAGMA journal_mode=WAL").fetchone()[0].lower() != "wal":
            raise JournalError(f"journal {self.path}: cannot switch to WAL mode")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("BEGIN IMMEDIATE")
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                db.execute(statement)
        db.execute(f"PRAGMA application_id={APPLICATION_ID}")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            db.execute("ROLLBACK")
            raise JournalError(
                f"journal {self.path}: schema version {version} is not {SCHEMA_VERSION}"
            )
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        db.execute("COMMIT")
        db.execute("PRAGMA quick_check").fetchone()

    def load(self, now_wall: float | None = None) -> Recovered:
        """Read back every task and reserve the next block of worker ids (committed now)."""
        db = self._connection()
        now_wall = time.time() if now_wall is None else now_wall
        out = Recovered()
        try:
            while True:
                cursor = db.execute(
                    "DELETE FROM tasks WHERE rowid IN (SELECT rowid FROM tasks"
                    " WHERE expires_at IS NOT NULL AND expires_at <= ? LIMIT ?)",
                    (now_wall, PRUNE_BATCH),
                )
                out.pruned += cursor.rowcount
                if cursor.rowcount < PRUNE_BATCH:
                    break
            row = db.execute("SELECT value FROM meta WHERE key='worker_id_ceiling'").fetchone()
            out.first_worker_id = row[0] if row else 1
            self.ceiling = self.durable_ceiling = out.first_worker_id + WORKER_ID_BLOCK
            db.execute(_CEILING, (self.ceiling,))  # autocommit: on disk before any REGISTER
            for r in db.execute(
                "SELECT ref, host, port, task_id, payload, state, attempts, failed_on, queued_at,"
                " result, error, notified, expires_at FROM tasks ORDER BY ref"
            ):
                out.tasks.append(
                    TaskRow(
                        ref=r[0],
                        host=r[1],
                        port=r[2],
                        task_id=r[3],
                        payload=bytes(r[4]),
                        state=r[5],
                        attempts=r[6],
                        failed_on=list(json.loads(r[7])),
                        queued_at=r[8],
                        result=bytes(r[9] or b""),
                        error=r[10] or "",
                        notified=bool(r[11]),
                        expires_at=r[12],
                    )
                )
            out.next_ref = (out.tasks[-1].ref + 1) if out.tasks else 1
        except (sqlite3.Error, ValueError, TypeError) as exc:
            raise JournalError(f"journal {self.path}: cannot read it back: {exc}") from None
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

    def accepting(self) -> str:
        """Why new tasks must be refused right now ("" when they are welcome)."""
        return self.failing

    def task_added(self, ref: int, host: str, port: int, task_id: int, payload: bytes) -> None:
        self._stage((_INSERT, (ref, host, port, task_id, payload, time.time())))

    def task_progress(
        self, ref: int, state: str, attempts: int, failed_on: tuple[int, ...]
    ) -> None:
        self._stage((_PROGRESS, (state, attempts, json.dumps(sorted(failed_on)), time.time(), ref)))

    def task_finished(self, ref: int, state: str, result: bytes, error: str) -> None:
        self._stage((_FINISH, (state, result, error, ref)))

    def task_notified(self, ref: int, retention: float) -> None:
        self._stage((_NOTIFIED, (time.time() + retention, ref)))

    def task_forgotten(self, ref: int) -> None:
        self._stage((_FORGET, (ref,)))

    def latest_generation(self) -> int:
        """The newest generation holding any change: what an outgoing datagram waits for."""
        return self.generation if self._staged else self.generation - 1

    def reserve_worker_ids(self, next_id: int) -> None:
        """Stage the next block of worker ids once `next_id` is half-way through this one."""
        if next_id + WORKER_ID_BLOCK // 2 >= self.ceiling:
            self.ceiling = next_id + WORKER_ID_BLOCK
            self._stage((_CEILING, (self.ceiling,)))
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
        generation = self.generation
        self.generation += 1
        return batch, generation

    def restage(self, batch: list[Op]) -> None:
        """A commit failed: its changes go first into the next attempt. Whatever waited for
        them waits for that attempt's generation, which is higher."""
        self._staged[:0] = batch

    def write(self, batch: list[Op]) -> None:
        """Run in a thread: apply one batch in one transaction (raises sqlite3.Error)."""
        db = self._connection()
        db.execute("BEGIN")
        try:
            for sql, params in batch:
                db.execute(sql, params)
            db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise
