"""The Redis stream door's names and atomic steps, shared by the controller and the client. Pure.

DESIGN.md section 10: producers `XADD <stream> * payload <bytes> [id <id>] [name <name>]`;
controllers read it through one consumer group; each outcome goes to the hash
`job:<id>` (state, result, error, updated_at) and to the stream
`<stream>:results` (id, state) before the entry is acknowledged.

Writing an outcome and acknowledging its entry is one Lua script, so that it
is atomic and can be repeated: a job whose hash is already final keeps the
outcome it has (first writer wins, so every job has exactly one final outcome,
and one results entry, however many controllers ran it), and the entry is
acknowledged either way. Canceling is another script, used by the client.
"""

from __future__ import annotations

import hashlib
import uuid

# The states a job's hash may hold once it ended (section 7's words).
FINAL_STATES = ("finished", "failed", "canceled", "deleted")
# How long a results stream grows before old entries are trimmed (approximately).
RESULTS_MAXLEN = 100_000
# Where a cancel is announced, so that the controller running the job stops it at once.
CANCEL_ERROR = "canceled by a user"


def job_key(job_id: str) -> str:
    return f"job:{job_id}"


def results_stream(stream: str) -> str:
    return f"{stream}:results"


def cancel_channel(stream: str) -> str:
    return f"{stream}:cancel"


def entry_job_id(stream: str, entry_id: str) -> str:
    """The id of an entry that names none: a UUID4-form id derived from the stream and the
    entry id, so that every controller that reads (or claims) the entry gives its job the
    same id, and the final-state check works for it too."""
    digest = hashlib.sha1(f"{stream}\0{entry_id}".encode()).digest()[:16]
    return str(uuid.UUID(bytes=digest, version=4)).upper()


_IS_FINAL = " or ".join(f"s == '{state}'" for state in FINAL_STATES)

# KEYS: job hash, results stream, jobs stream.
# ARGV: state, result, error, updated_at, retention (ms), group, job id, entry ids...
OUTCOME_SCRIPT = f"""
local s = redis.call('HGET', KEYS[1], 'state')
local written = 0
if not ({_IS_FINAL}) then
  redis.call('HSET', KEYS[1], 'state', ARGV[1], 'result', ARGV[2], 'error', ARGV[3],
             'updated_at', ARGV[4])
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', '{RESULTS_MAXLEN}', '*', 'id', ARGV[7],
             'state', ARGV[1])
  written = 1
end
for i = 8, #ARGV do
  redis.call('XACK', KEYS[3], ARGV[6], ARGV[i])
end
return written
"""

# KEYS: job hash. ARGV: state, updated_at. A live state is written only over a live one.
PROGRESS_SCRIPT = f"""
local s = redis.call('HGET', KEYS[1], 'state')
if ({_IS_FINAL}) then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'updated_at', ARGV[2])
return 1
"""

# KEYS: job hash, results stream, cancel channel. ARGV: job id, updated_at, error, retention (ms).
# Returns the state the job has afterwards.
CANCEL_SCRIPT = f"""
local s = redis.call('HGET', KEYS[1], 'state')
if ({_IS_FINAL}) then return s end
redis.call('HSET', KEYS[1], 'state', 'canceled', 'error', ARGV[3], 'updated_at', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', '{RESULTS_MAXLEN}', '*', 'id', ARGV[1],
           'state', 'canceled')
redis.call('PUBLISH', KEYS[3], ARGV[1])
return 'canceled'
"""
