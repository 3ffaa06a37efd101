"""The journal's SQL: its schema, the migrations from older versions, and every statement
it runs, apart from the code that stages and writes them (controller/journal.py).

A change is staged as (statement, parameters) with the job's ref as the last parameter;
the *_IN_INSERT positions say where a later change's values sit in a job's INSERT, so that
a change to a job added in the same batch rewrites that insert instead of adding a row.
"""

from __future__ import annotations

# "JCTL": marks the file as ours, so a foreign SQLite file is refused, not altered.
APPLICATION_ID = 0x4A43544C
SCHEMA_VERSION = 5
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
-- The last columns have no comments, so that SQLite's DROP COLUMN can take them out in a
-- test: log (its log lines, a JSON list), options (its options as JSON: queue, priority,
-- times, retries, or empty for the configuration's) and base (its attempts when a user last
-- retried it, from which max_retries counts), history (its attempts that ended without
-- ending it, a JSON list of [worker, started, ended, outcome, error, usage?]), ran_on (the
-- worker of its latest attempt), usage (what its latest attempt used, JSON [wall, cpu,
-- max_rss, memory_peak], or empty) and reason (why it failed: limit, error, timeout, lost,
-- placement, or empty while it has not).
CREATE TABLE IF NOT EXISTS jobs (
    ref INTEGER PRIMARY KEY,
    id TEXT NOT NULL,                 -- the job's id (udp-<host>-<port>-<task_id> for UDP jobs)
    door TEXT NOT NULL,               -- udp, http, redis
    host TEXT NOT NULL DEFAULT '',    -- a UDP job's client address
    port INTEGER NOT NULL DEFAULT 0,
    task_id INTEGER NOT NULL,
    name TEXT NOT NULL DEFAULT '',
    payload BLOB NOT NULL,
    state TEXT NOT NULL,              -- scheduled, pending, working, finished, failed, canceled,
                                      -- deleted
    attempts INTEGER NOT NULL DEFAULT 0,
    failed_on TEXT NOT NULL DEFAULT '[]',
    queued_at REAL NOT NULL,          -- when it (re-)entered the queue (scheduled: when due)
    added_at REAL NOT NULL,
    result BLOB,
    error TEXT,
    failed_post INTEGER NOT NULL DEFAULT 0,
    notified INTEGER NOT NULL DEFAULT 0,  -- 1: the submitter has the outcome, or repeats ran out
    expires_at REAL,                  -- when a finished record may be forgotten
    info_url TEXT NOT NULL DEFAULT '',
    download_url TEXT NOT NULL DEFAULT '',
    log TEXT NOT NULL DEFAULT '[]',
    options TEXT NOT NULL DEFAULT '',
    base INTEGER NOT NULL DEFAULT 0,
    history TEXT NOT NULL DEFAULT '',
    ran_on INTEGER NOT NULL DEFAULT 0,
    usage TEXT NOT NULL DEFAULT '',
    reason TEXT NOT NULL DEFAULT ''
);
-- Queues whose jobs are not handed out until resumed.
CREATE TABLE IF NOT EXISTS paused (queue TEXT PRIMARY KEY);
-- Queues' limits (controller/core/limits.py): concurrency (NULL: none), rate ("N/s", "N/m",
-- NULL: none). A table of its own: a journal of an older version gains it as is.
CREATE TABLE IF NOT EXISTS queue_limits (queue TEXT PRIMARY KEY, concurrency INTEGER, rate TEXT);
-- The lease of each job a poller holds: it must show it to keep the job after a restart.
CREATE TABLE IF NOT EXISTS leases (ref INTEGER PRIMARY KEY, lease TEXT NOT NULL);
-- Each periodic job's latest due time made (for a new one: the last before it started).
CREATE TABLE IF NOT EXISTS schedules (name TEXT PRIMARY KEY, last_due REAL);
-- What each job wrote to stderr: the newest output_retention bytes (a table of its own, so
-- that an append rewrites this row only, and a journal of an older version gains it as is).
CREATE TABLE IF NOT EXISTS output (ref INTEGER PRIMARY KEY, data BLOB NOT NULL);
"""

# Version 1 kept UDP tasks only, in the words of the UDP door.
MIGRATE_1_TO_2 = """
ALTER TABLE tasks RENAME TO jobs;
ALTER TABLE jobs ADD COLUMN id TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN door TEXT NOT NULL DEFAULT 'udp';
ALTER TABLE jobs ADD COLUMN name TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN added_at REAL NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN failed_post INTEGER NOT NULL DEFAULT 0;
UPDATE jobs SET id = 'udp-' || host || '-' || port || '-' || task_id, added_at = queued_at,
    failed_post = (state = 'failed_post'),
    state = CASE state WHEN 'queued' THEN 'pending' WHEN 'running' THEN 'working'
                       WHEN 'success' THEN 'finished' ELSE 'failed' END
"""

# Version 2 kept neither a job's links nor its log.
MIGRATE_2_TO_3 = """
ALTER TABLE jobs ADD COLUMN info_url TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN download_url TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN log TEXT NOT NULL DEFAULT '[]'
"""

# Version 3 kept no job options (every job took the configuration's).
MIGRATE_3_TO_4 = """
ALTER TABLE jobs ADD COLUMN options TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN base INTEGER NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN history TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN ran_on INTEGER NOT NULL DEFAULT 0
"""

# Version 4 kept neither what a job's last attempt used nor why the job failed.
MIGRATE_4_TO_5 = """
ALTER TABLE jobs ADD COLUMN usage TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN reason TEXT NOT NULL DEFAULT ''
"""

INSERT = (
    "INSERT OR REPLACE INTO jobs (ref, id, door, host, port, task_id, name, payload, state,"
    " attempts, failed_on, queued_at, added_at, result, error, failed_post, info_url,"
    " download_url, log, options, base, ran_on, usage, reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?,"
    " ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
PROGRESS = "UPDATE jobs SET state = ?, attempts = ?, failed_on = ?, queued_at = ? WHERE ref = ?"
FINISH = (
    "UPDATE jobs SET state = ?, attempts = ?, result = ?, error = ?, failed_post = ?, ran_on = ?,"
    " usage = ?, reason = ?, payload = x'', notified = 0, expires_at = NULL WHERE ref = ?"
)
# A failed or canceled job keeps its payload: a user may retry it.
FINISH_KEEP = (
    "UPDATE jobs SET state = ?, attempts = ?, result = ?, error = ?, failed_post = ?, ran_on = ?,"
    " usage = ?, reason = ?, notified = 0, expires_at = NULL WHERE ref = ?"
)
# Where PROGRESS's and FINISH's values (their parameters before the ref) sit among
# INSERT's, so that a change to a job added in the same batch rewrites its insert; and
# the payload, which FINISH empties.
PROGRESS_IN_INSERT = (8, 9, 10, 11)  # state, attempts, failed_on, queued_at
# state, attempts, result, error, failed_post, ran_on, usage, reason
FINISH_IN_INSERT = (8, 9, 13, 14, 15, 21, 22, 23)
PAYLOAD_IN_INSERT = 7
LOG_IN_INSERT = 18
# state, base, result, error, failed_post, reason: a retry of a job whose insert is in the
# batch.
RETRIED_IN_INSERT = (8, 20, 13, 14, 15, 23)
# A job started and finished within one batch (most short jobs under load): one UPDATE
# carrying both, written where the start's was.
PROGRESS_FINISH = (
    "UPDATE jobs SET state = ?, attempts = ?, failed_on = ?, queued_at = ?, result = ?,"
    " error = ?, failed_post = ?, ran_on = ?, usage = ?, reason = ?, payload = x'',"
    " notified = 0, expires_at = NULL WHERE ref = ?"
)
PROGRESS_FINISH_KEEP = (
    "UPDATE jobs SET state = ?, attempts = ?, failed_on = ?, queued_at = ?, result = ?,"
    " error = ?, failed_post = ?, ran_on = ?, usage = ?, reason = ?, notified = 0,"
    " expires_at = NULL WHERE ref = ?"
)
RETRIED = (
    "UPDATE jobs SET state = 'pending', base = ?, queued_at = ?, result = NULL, error = NULL,"
    " failed_post = 0, reason = '', notified = 0, expires_at = NULL WHERE ref = ?"
)
HISTORY = "UPDATE jobs SET history = ? WHERE ref = ?"
PAUSED = "INSERT OR REPLACE INTO paused (queue) VALUES (?)"
RESUMED = "DELETE FROM paused WHERE queue = ?"
LIMITED = "INSERT OR REPLACE INTO queue_limits (concurrency, rate, queue) VALUES (?, ?, ?)"
UNLIMITED = "DELETE FROM queue_limits WHERE queue = ?"
NOTIFIED = "UPDATE jobs SET notified = 1, expires_at = ? WHERE ref = ?"
LOG = "UPDATE jobs SET log = ? WHERE ref = ?"
FORGET = "DELETE FROM jobs WHERE ref = ?"
DELETED = "UPDATE jobs SET state = 'deleted', payload = x'', result = NULL WHERE ref = ?"
LEASED = "INSERT OR REPLACE INTO leases (ref, lease) VALUES (?, ?)"
UNLEASED = "DELETE FROM leases WHERE ref = ?"
# Leases of jobs no longer live (ended, or forgotten), dropped at start.
STALE_LEASES = (
    "DELETE FROM leases WHERE ref NOT IN"
    " (SELECT ref FROM jobs WHERE state IN ('pending', 'working'))"
)
SCHEDULED = "INSERT OR REPLACE INTO schedules (name, last_due) VALUES (?, ?)"
# Output appended to a job: ?1 the bytes kept at most, ?2 the new bytes, ?3 the ref (last, as
# in every change: `journal._rejected` reads it there). SQLite's || on two blobs joins their bytes;
# substr with a negative start keeps the newest.
OUTPUT = (
    "INSERT INTO output (ref, data) VALUES (?3, ?2) ON CONFLICT(ref) DO UPDATE"
    " SET data = substr(CAST(data || excluded.data AS BLOB), -?1)"
)
DROP_OUTPUT = "DELETE FROM output WHERE ref = ?"
# Output of jobs no longer in the journal (pruned at start).
STALE_OUTPUT = "DELETE FROM output WHERE ref NOT IN (SELECT ref FROM jobs)"
CEILING = "INSERT OR REPLACE INTO meta (key, value) VALUES ('worker_id_ceiling', ?)"
