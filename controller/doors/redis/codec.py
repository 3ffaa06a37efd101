"""The Redis stream door's names and atomic steps, shared by the controller and the client. Pure.

Producers `XADD <stream> * payload <bytes> [id <id>] [name <name>] [option <value>...]`
(queue `default`; queue `q` is the stream `<stream>.q`, see `queue_stream`);
controllers read each stream through one consumer group; each outcome goes to the hash
`job:<id>` (state, result, error, updated_at) and to the stream
`<stream>:results` (id, state) before the entry is acknowledged.

Writing an outcome and acknowledging its entry is one Lua script, so that it
is atomic and can be repeated: a job whose hash is already final keeps the
outcome it has (first writer wins, so every job has exactly one final outcome,
and one results entry, however many controllers ran it), and the entry is
acknowledged either way. Canceling is another script, used by the client, and so is
retrying a failed or canceled job: it makes the hash `pending` again and announces the id
on `<stream>:retry`, where the controller that ran the job puts it back in its queue.
"""

from __future__ import annotations

import hashlib
import uuid
from urllib.parse import urlsplit, urlunsplit

from controller.job_states import JobState
from controller.options import DEFAULT_QUEUE

# The states a job's hash may hold once it ended (finished, failed, canceled, deleted).
FINAL_STATES = tuple(state.value for state in JobState if state.final)
# How long a results stream grows before old entries are trimmed (approximately), where the
# writer gives no time to trim by (a cancel through the client).
RESULTS_MAXLEN = 100_000
# The state READ_SCRIPT (and the door's other reads) give an entry whose `job:<id>` key is
# not a hash: that entry fails alone.
WRONG_TYPE = "!wrongtype"
# The state READ_SCRIPT gives in place of an entry's for a stream it could not read.
READ_FAILED = "!failed"
# The state of an entry whose unique_key a live job held: no job was made; its hash's
# `duplicate_of` names that job (DESIGN.md section 17).
DUPLICATE = "duplicate"
# The `error` of a job canceled through the client.
CANCEL_ERROR = "canceled by a user"


def shown_url(url: str) -> str:
    """The Redis URL for logs: its password replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


ACKED_SUFFIX = ":acked"

# A job's hash is JOB_PREFIX + its id (job_key; READ_SCRIPT builds the same name in Lua).
JOB_PREFIX = "job:"


def job_key(job_id: str) -> str:
    return f"{JOB_PREFIX}{job_id}"


def queue_stream(stream: str, queue: str) -> str:
    """The stream of a queue: `stream` itself for queue `default`, else `<stream>.<queue>`."""
    return stream if queue == DEFAULT_QUEUE else f"{stream}.{queue}"


def results_stream(stream: str) -> str:
    return f"{stream}:results"


def acked_set(stream: str) -> str:
    """The sorted set of a jobs stream's acknowledged entries, scored by when (ms): what
    TRIM_SCRIPT removes from the stream once result_retention has passed (OUTCOMES_SCRIPT
    builds the same name in Lua)."""
    return f"{stream}{ACKED_SUFFIX}"


def cancel_channel(stream: str) -> str:
    """Where a cancel is announced, so that the controller running the job stops it at once."""
    return f"{stream}:cancel"


def retry_channel(stream: str) -> str:
    """Where a retry is announced, so that the controller that ran the job runs it again."""
    return f"{stream}:retry"


def entry_job_id(stream: str, entry_id: str) -> str:
    """The id of an entry that names none: a UUID4-form id derived from the stream and the
    entry id, so that every controller that reads (or claims) the entry gives its job the
    same id, and the final-state check works for it too."""
    digest = hashlib.sha1(f"{stream}\0{entry_id}".encode()).digest()[:16]
    return str(uuid.UUID(bytes=digest, version=4)).upper()


_IS_FINAL = " or ".join(f"s == '{state}'" for state in FINAL_STATES)

# Outcomes of several jobs, each written unless its hash is final already, then their
# entries acknowledged (and noted, with the time, for TRIM_SCRIPT). A `job:<id>` that is
# not a hash keeps no outcome (the results stream still says it), and a key of the wrong
# type never fails the others: each call that touches one is a pcall. An entry is named by
# its stream (one per queue) and its id; the stream's acknowledged set is built from the
# stream's name, as `acked_set` does (fine on one Redis, not on Redis Cluster).
# KEYS: results stream, then one job hash per job.
# ARGV: group, updated_at, retention (ms), the results stream's oldest id to keep, now (ms),
# then per job: id, state, result, error, the number of its entries, and each entry's stream
# and id. For state `duplicate` (DUPLICATE: the entry's unique_key was held, no job made) the
# error's place holds the id of the job that holds the key, written as `duplicate_of`.
OUTCOMES_SCRIPT = f"""
local a = 6
local written = 0
for k = 2, #KEYS do
  local id, state, result, err = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local acks = tonumber(ARGV[a + 4])
  a = a + 5
  local s = redis.pcall('HGET', KEYS[k], 'state')
  local hash = type(s) ~= 'table'
  if not hash or not ({_IS_FINAL}) then
    if hash and state == '{DUPLICATE}' then
      redis.call('HSET', KEYS[k], 'state', state, 'duplicate_of', err, 'updated_at', ARGV[2])
      redis.call('PEXPIRE', KEYS[k], ARGV[3])
    elseif hash then
      redis.call('HSET', KEYS[k], 'state', state, 'result', result, 'error', err,
                 'updated_at', ARGV[2])
      redis.call('PEXPIRE', KEYS[k], ARGV[3])
    end
    redis.pcall('XADD', KEYS[1], 'MINID', '~', ARGV[4], '*', 'id', id, 'state', state)
    written = written + 1
  end
  for i = 1, acks do
    redis.pcall('XACK', ARGV[a], ARGV[1], ARGV[a + 1])
    redis.pcall('ZADD', ARGV[a] .. '{ACKED_SUFFIX}', ARGV[5], ARGV[a + 1])
    a = a + 2
  end
end
return written
"""

# Entries of the jobs stream acknowledged before a cutoff are deleted (a page at a time), and
# the results stream keeps its entries from a cutoff on (approximately, as XTRIM MINID ~).
# KEYS: acknowledged set, jobs stream, results stream.
# ARGV: acknowledged before (ms), page size, the results stream's oldest id to keep.
# Returns how many entries it deleted (a full page: call again).
TRIM_SCRIPT = """
local ids = redis.pcall('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1], 'LIMIT', 0, ARGV[2])
if type(ids) ~= 'table' or ids.err then ids = {} end
if #ids > 0 then
  redis.pcall('XDEL', KEYS[2], unpack(ids))
  redis.pcall('ZREM', KEYS[1], unpack(ids))
end
redis.pcall('XTRIM', KEYS[3], 'MINID', '~', ARGV[3])
return #ids
"""

# New entries for a consumer (XREADGROUP without blocking) from each of several streams,
# each with the state of its job's hash when the entry names its job (`id`): one round trip
# for all. It reads hashes it is not given in KEYS (their names come from the entries): fine
# on one Redis, not on Redis Cluster.
# A stream that cannot be read (its key holds another type, its group is gone) fails alone:
# its place in the answer says why, and the other streams are read.
# KEYS: jobs streams. ARGV: group, consumer, then how many entries at most from each stream.
# Returns {entry id, fields, state, the stream's place in KEYS} each, and for a stream that
# failed {"", the error, READ_FAILED, its place}.
READ_SCRIPT = f"""
local out = {{}}
for k = 1, #KEYS do
  local r = redis.pcall('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[2 + k],
                        'STREAMS', KEYS[k], '>')
  if type(r) == 'table' and r.err then
    out[#out + 1] = {{'', r.err, '{READ_FAILED}', k}}
  elseif r then
    for _, e in ipairs(r[1][2]) do
      local fields = e[2]
      local state = false
      for j = 1, #fields, 2 do
        if fields[j] == 'id' then
          state = redis.pcall('HGET', '{JOB_PREFIX}' .. fields[j + 1], 'state')
          if type(state) == 'table' then state = '{WRONG_TYPE}' end
        end
      end
      out[#out + 1] = {{e[1], fields, state or '', k}}
    end
  end
end
return out
"""

# The entries a consumer holds, kept: each that is still pending on this consumer is
# re-claimed for it (its idle time starts again) when asked, or only looked at; those that
# are not (another consumer claimed it, or it was acknowledged) are returned. Checking and
# claiming in one script, so that an entry claimed away is never taken back.
# KEYS: jobs stream. ARGV: group, consumer, then per entry: 1 (claim) or 0 (look), its id.
HOLD_SCRIPT = """
local gone = {}
for i = 3, #ARGV, 2 do
  local id = ARGV[i + 1]
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    if ARGV[i] == '1' then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'JUSTID')
    end
  else
    gone[#gone + 1] = id
  end
end
return gone
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

# The answer of RETRY_SCRIPT when no controller listens on the retry channel (the hash is left
# as it was: nobody would run the job).
NO_LISTENER = "!nolistener"

# KEYS: job hash, retry channel. ARGV: job id, updated_at. A failed or canceled job's hash becomes
# `pending` again (no result, no error, no expiry: as a new job's) and its id is announced.
# Returns the state the job has afterwards (NO_LISTENER: unchanged, nobody heard), or "" when
# it has no hash.
RETRY_SCRIPT = f"""
local s = redis.call('HGET', KEYS[1], 'state')
if not s then return '' end
if s ~= 'failed' and s ~= 'canceled' then return s end
if redis.call('PUBLISH', KEYS[2], ARGV[1]) == 0 then return '{NO_LISTENER}' end
redis.call('HSET', KEYS[1], 'state', 'pending', 'updated_at', ARGV[2])
redis.call('HDEL', KEYS[1], 'result', 'error')
redis.call('PERSIST', KEYS[1])
return 'pending'
"""
