"""The journal's file: opened (made private to the controller's user, checked to be ours,
brought to this schema version, checked for integrity) and read back at start.

What is read back (`Recovered`: the jobs as `JobRow`s, the paused queues and the queues'
limits, the schedules' last due times, where worker ids continue) is what recovery puts back;
expired records are pruned first.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from controller import journal_sql as sql
from controller.errors import CannotStart
from controller.job_ids import DoorName

log = logging.getLogger("controller.journal")

# Worker ids are reserved in blocks committed ahead of use, so that a crash can
# never hand out an id twice and no REGISTER waits for a commit.
WORKER_ID_BLOCK = 1000
# Rows removed per transaction when pruning expired records at start-up.
PRUNE_BATCH = 1000


class JournalError(CannotStart):
    """The journal cannot be used; the message names the path (exit status 2 at start-up)."""


@dataclass
class JobRow:
    ref: int
    id: str
    door: DoorName
    host: str
    port: int
    task_id: int
    name: str
    payload: bytes
    state: str  # pending, working, finished, failed
    attempts: int
    failed_on: list[int]
    queued_at: float
    added_at: float
    result: bytes
    error: str
    failed_post: bool
    notified: bool
    expires_at: float | None
    lease: str = ""  # the lease of the poller that held it ("": none)
    info_url: str = ""
    download_url: str = ""
    log: list[str] = field(default_factory=list)
    options: str = ""  # JSON (controller.options.to_json); "": the configuration's
    retried_at: int = 0  # column `base`: its attempts when a user last retried it
    history: str = ""  # JSON: its attempts that ended without ending it
    ran_on: int = 0
    usage: str = ""  # JSON: what its latest attempt used ("": not measured)
    reason: str = ""  # why it failed ("": it has not)
    output: bytes = b""  # what it wrote to stderr (the newest output_retention bytes)


@dataclass
class Recovered:
    jobs: list[JobRow] = field(default_factory=list)
    first_worker_id: int = 1
    next_ref: int = 1
    pruned: int = 0
    paused: list[str] = field(default_factory=list)
    # queue -> (concurrency, rate text), None for none
    limits: dict[str, tuple[int | None, str | None]] = field(default_factory=dict)
    schedules: dict[str, float] = field(default_factory=dict)  # name -> last due time


def read_text(value: str | bytes | None) -> str:
    """The inverse of `stored_text` ("" for NULL)."""
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogatepass")
    return value


def _run_script(db: sqlite3.Connection, script: str) -> None:
    """Each statement of `script` inside the caller's transaction (executescript would commit)."""
    for statement in script.split(";"):
        if statement.strip():
            db.execute(statement)


def _owner_only(path: Path) -> None:
    """Job payloads and results are for the controller's user alone: a new journal is made
    0600 before SQLite opens it (SQLite gives its -wal and -shm files the same mode), and
    an existing one of ours that others could read is made 0600, side files included. Only
    a regular file is a journal: anything else (/dev/null, a FIFO) is refused untouched."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise JournalError(f"journal {path}: not a regular file")
        if st.st_mode & 0o077 and st.st_uid == os.geteuid():
            log.warning(
                "journal %s was readable by others (mode %o): making it 0600",
                path,
                stat.S_IMODE(st.st_mode),
            )
            os.fchmod(fd, 0o600)
            for side in ("-wal", "-shm", "-journal"):
                _side_owner_only(f"{path}{side}")
    finally:
        os.close(fd)


def _side_owner_only(path: str) -> None:
    """A journal's side file made 0600, when it is a regular file of ours (not through a
    symbolic link: it is never one SQLite made)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # missing, or a link (ELOOP): left alone
        return
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def connect(path: Path, sync: str) -> sqlite3.Connection:
    """Open or create the journal file, ready to use (`sync`: SQLite's synchronous pragma,
    FULL or NORMAL); JournalError naming the path when unusable."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise JournalError(f"journal {path}: cannot create its directory: {exc.strerror}") from None
    try:
        _owner_only(path)
    except OSError as exc:
        raise JournalError(f"journal {path}: cannot open for writing: {exc.strerror}") from None
    try:
        db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as exc:
        raise JournalError(f"journal {path}: cannot open: {exc}") from None
    try:
        _prepare(db, path, sync)
    except sqlite3.Error as exc:
        db.close()
        raise JournalError(f"journal {path}: not usable: {exc}") from None
    except JournalError:
        db.close()
        raise
    return db


def _prepare(db: sqlite3.Connection, path: Path, sync: str) -> None:
    """Check the file is ours, switch to WAL, bring its schema to this version and check its
    integrity."""
    app_id = db.execute("PRAGMA application_id").fetchone()[0]
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if app_id != sql.APPLICATION_ID and (app_id != 0 or tables):
        raise JournalError(
            f"journal {path}: not a controller journal (application_id {app_id}, "
            f"tables {sorted(tables)}); refusing to touch it"
        )
    if db.execute("PRAGMA journal_mode=WAL").fetchone()[0].lower() != "wal":
        raise JournalError(f"journal {path}: cannot switch to WAL mode")
    db.execute(f"PRAGMA synchronous={sync}")
    db.execute("BEGIN IMMEDIATE")
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version not in (0, 1, 2, 3, 4, sql.SCHEMA_VERSION):
        db.execute("ROLLBACK")
        raise JournalError(f"journal {path}: schema version {version} is not {sql.SCHEMA_VERSION}")
    if version == 1:
        log.info("journal %s: upgrading from schema version 1", path)
        _run_script(db, sql.MIGRATE_1_TO_2)
    if version in (1, 2):
        if version == 2:
            log.info("journal %s: upgrading from schema version 2", path)
        _run_script(db, sql.MIGRATE_2_TO_3)
    if version in (1, 2, 3):
        if version == 3:
            log.info("journal %s: upgrading from schema version 3", path)
        _run_script(db, sql.MIGRATE_3_TO_4)
    if version in (1, 2, 3, 4):
        if version == 4:
            log.info("journal %s: upgrading from schema version 4", path)
        _run_script(db, sql.MIGRATE_4_TO_5)
    _run_script(db, sql.SCHEMA)
    db.execute(f"PRAGMA application_id={sql.APPLICATION_ID}")
    db.execute(f"PRAGMA user_version={sql.SCHEMA_VERSION}")
    db.execute("COMMIT")
    found = [str(row[0]) for row in db.execute("PRAGMA quick_check(5)")]
    if found != ["ok"]:  # nothing is dropped silently: the operator decides
        raise JournalError(
            f"journal {path}: fails its integrity check (PRAGMA quick_check): "
            + "; ".join(line.replace("\n", " ") for line in found)
        )


def read_back(db: sqlite3.Connection, path: Path, now_wall: float | None = None) -> Recovered:
    """Every job the file holds (after pruning those past their retention), and the next
    block of worker ids reserved (committed now: first_worker_id + WORKER_ID_BLOCK)."""
    now_wall = time.time() if now_wall is None else now_wall
    out = Recovered()
    try:
        while True:
            cursor = db.execute(
                "DELETE FROM jobs WHERE rowid IN (SELECT rowid FROM jobs"
                " WHERE expires_at IS NOT NULL AND expires_at <= ? LIMIT ?)",
                (now_wall, PRUNE_BATCH),
            )
            out.pruned += cursor.rowcount
            if cursor.rowcount < PRUNE_BATCH:
                break
        row = db.execute("SELECT value FROM meta WHERE key='worker_id_ceiling'").fetchone()
        out.first_worker_id = row[0] if row else 1
        ceiling = out.first_worker_id + WORKER_ID_BLOCK
        db.execute(sql.CEILING, (ceiling,))  # autocommit: on disk before any REGISTER
        db.execute(sql.STALE_LEASES)
        db.execute(sql.STALE_OUTPUT)
        leases = dict(db.execute("SELECT ref, lease FROM leases").fetchall())
        for name, last_due in db.execute("SELECT name, last_due FROM schedules"):
            if last_due is not None:
                out.schedules[str(name)] = float(last_due)
        outputs = {
            int(ref): bytes(data)
            for ref, data in db.execute("SELECT ref, data FROM output").fetchall()
        }
        for r in db.execute(
            "SELECT ref, id, door, host, port, task_id, name, payload, state, attempts,"
            " failed_on, queued_at, added_at, result, error, failed_post, notified,"
            " expires_at, info_url, download_url, log, options, base, history, ran_on,"
            " usage, reason FROM jobs ORDER BY ref"
        ):
            out.jobs.append(
                JobRow(
                    ref=r[0],
                    id=read_text(r[1]),
                    door=DoorName(r[2]),
                    host=r[3],
                    port=r[4],
                    task_id=r[5],
                    name=read_text(r[6]),
                    payload=bytes(r[7]),
                    state=r[8],
                    attempts=r[9],
                    failed_on=list(json.loads(r[10])),
                    queued_at=r[11],
                    added_at=r[12],
                    result=bytes(r[13] or b""),
                    error=read_text(r[14]),
                    failed_post=bool(r[15]),
                    notified=bool(r[16]),
                    expires_at=r[17],
                    lease=str(leases.get(r[0], "")),
                    info_url=read_text(r[18]),
                    download_url=read_text(r[19]),
                    log=[str(line) for line in json.loads(r[20])],
                    options=str(r[21]),
                    retried_at=int(r[22]),
                    history=str(r[23]),
                    ran_on=int(r[24]),
                    usage=str(r[25]),
                    reason=str(r[26]),
                    output=outputs.get(r[0], b""),
                )
            )
        out.paused = [str(row[0]) for row in db.execute("SELECT queue FROM paused")]
        out.limits = {
            str(q): (None if c is None else int(c), None if r is None else str(r))
            for q, c, r in db.execute("SELECT queue, concurrency, rate FROM queue_limits")
        }
        out.next_ref = (out.jobs[-1].ref + 1) if out.jobs else 1
    except (sqlite3.Error, ValueError, TypeError) as exc:
        raise JournalError(f"journal {path}: cannot read it back: {exc}") from None
    return out
