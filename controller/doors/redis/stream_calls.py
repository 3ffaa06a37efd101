"""The Redis stream door's calls to Redis, and the arguments and answers of its scripts.

The door's busy calls, the scripts of codec.py that read new entries and write
outcomes, go through a link (script_link.py); this class builds their arguments
and reads their answers. Its other calls (blocking reads, claims, group set-up,
lag) are blocking redis-py calls that the door (base.py) runs in a worker
thread. It holds the connection pool and no state of the door's (what it holds,
what waits to be written): arguments in, answers out. The one exception is the
claim cursors (one per stream), which only the door's keeper task moves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from controller.config import RedisSettings
from controller.doors.redis import codec

log = logging.getLogger("controller.redis")

# How long one XREADGROUP waits for new entries (ms); also bounds a shutdown's wait.
READ_BLOCK_MS = 1000
# Outcomes written per round trip, at most (and entries read per page of our own).
WRITE_BATCH = 500
# Acknowledged entries deleted per script call (each call holds Redis for its page).
TRIM_PAGE = 1000
# Pending entries looked over per claim (our own among them are passed over).
CLAIM_PAGE = 100
# READ_SCRIPT's mark of a stream it could not read, as it comes back.
READ_FAILED = codec.READ_FAILED.encode()


@dataclass(frozen=True, slots=True)
class Outcome:
    state: str
    result: bytes
    error: str
    # For state `duplicate`: the live job that holds the entry's unique_key.
    duplicate_of: str = ""


@dataclass(frozen=True, slots=True)
class Entry:
    stream: str  # the jobs stream it came from (one per queue)
    entry_id: str
    fields: dict[bytes, bytes]
    hash_state: str  # the state its job:<id> hash has ("" when none)
    job_id: str


# An entry as this controller holds it: (its stream, its id).
EntryRef = tuple[str, str]


class StreamCalls:
    """One consumer's blocking calls on the jobs streams (one per queue) of one group."""

    def __init__(
        self, settings: RedisSettings, consumer: str, retention_ms: int, claim_after_ms: int
    ) -> None:
        self.settings = settings
        self.group = settings.group
        self.consumer = consumer
        self.retention_ms = retention_ms
        self.results = codec.results_stream(settings.stream)
        self.claim_after_ms = claim_after_ms
        # ValueError for a URL redis-py cannot use (the door turns it into a StartupError).
        self.redis = redis.Redis.from_url(
            settings.url, socket_connect_timeout=5, socket_timeout=READ_BLOCK_MS / 1000 + 10
        )
        self._claim_cursor: dict[str, str] = {}  # stream -> where the next claim looks from

    def close(self) -> None:
        self.redis.close()

    def pubsub(self) -> Any:
        return self.redis.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]

    def ensure_group(self, stream: str) -> None:
        try:
            self.redis.xgroup_create(stream, self.group, id="0", mkstream=True)
            log.info("redis: created group %r on stream %r", self.group, stream)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read_own(self, stream: str, start: str) -> tuple[list[Entry], str]:
        """A page of our pending entries of `stream` after `start`, and the last id on it (""
        at the end). Entries deleted from the stream while pending are acknowledged here."""
        answer: Any = self.redis.xreadgroup(
            self.group, self.consumer, {stream: start}, count=WRITE_BATCH
        )
        raw = answer[0][1] if answer else []
        if not raw:
            return [], ""
        # redis-py gives an entry deleted from the stream as no fields (an entry has >= 1).
        deleted = [entry_id for entry_id, fields in raw if not fields]
        if deleted:
            self.redis.xack(stream, self.group, *deleted)
        return self.with_states(stream, raw), raw[-1][0].decode()

    def read_request(self, counts: dict[str, int]) -> tuple[list[Any], list[Any]]:
        """Keys and arguments of `codec.READ_SCRIPT`: up to `counts[stream]` new entries of
        each stream, no waiting."""
        return list(counts), [self.group, self.consumer, *counts.values()]

    def entries_of(
        self, waiting: Sequence[Any], read: Sequence[str]
    ) -> tuple[list[Entry], dict[str, str]]:
        """The entries in an answer of `codec.READ_SCRIPT` over the streams `read`, and
        the streams it could not read, each with its error."""
        entries = []
        failed: dict[str, str] = {}
        for entry_id, flat, state, place in waiting:
            stream = read[int(place) - 1]
            if state == READ_FAILED:
                failed[stream] = _text(flat)
                continue
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            eid = entry_id.decode()
            job_id = self.job_id(stream, eid, fields)
            entries.append(Entry(stream, eid, fields, state.decode(), job_id))
        return entries, failed

    def read_blocking(self, read: Sequence[str], count: int) -> list[Entry]:
        """New entries of the streams `read`, up to `count` of each, waiting up to
        READ_BLOCK_MS for the first; then their hashes' states (a second round trip)."""
        answer: Any = self.redis.xreadgroup(
            self.group, self.consumer, dict.fromkeys(read, ">"), count=count, block=READ_BLOCK_MS
        )
        entries = []
        for name, raw in answer or ():
            entries += self.with_states(name.decode(), raw)
        return entries

    def with_states(self, stream: str, raw: Sequence[tuple[Any, Any]]) -> list[Entry]:
        """Entries of `stream` with their job's id and the state of its hash (one round trip)."""
        entries = []
        for entry_id, fields in raw:
            if not fields:  # deleted from the stream while pending (redis-py: {} or None)
                continue
            eid = entry_id.decode()
            entries.append(Entry(stream, eid, fields, "", self.job_id(stream, eid, fields)))
        if not entries:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for entry in entries:
            pipe.hget(codec.job_key(entry.job_id), "state")
        # A `job:<id>` of another type fails its entry alone, not the read.
        states = pipe.execute(raise_on_error=False)
        return [
            Entry(e.stream, e.entry_id, e.fields, _state(s), e.job_id)
            for e, s in zip(entries, states, strict=True)
        ]

    @staticmethod
    def job_id(stream: str, entry_id: str, fields: dict[bytes, bytes]) -> str:
        given = fields.get(b"id")
        if given:
            return given.decode("utf-8", "replace")
        return codec.entry_job_id(stream, entry_id)

    def outcomes_request(
        self, outcomes: dict[str, Outcome], acks: dict[str, list[EntryRef]], stamp: str
    ) -> tuple[list[Any], list[Any]]:
        """Keys and arguments of `codec.OUTCOMES_SCRIPT` for these outcomes and entries."""
        keys = [self.results]
        now_ms = int(time.time() * 1000)
        oldest = f"{max(0, now_ms - self.retention_ms)}-0"
        args: list[Any] = [self.group, stamp, self.retention_ms, oldest, now_ms]
        for job_id, outcome in outcomes.items():
            keys.append(codec.job_key(job_id))
            acked = acks[job_id]
            # surrogatepass: an error text may hold a lone surrogate (legal in JSON, not UTF-8).
            # A duplicate's slot for the error carries the id of the job holding its key.
            error = (outcome.duplicate_of or outcome.error).encode("utf-8", "surrogatepass")
            args += [job_id, outcome.state, outcome.result, error, len(acked)]
            for stream, entry_id in acked:
                args += [stream, entry_id]
        return keys, args

    def refresh(
        self, held: dict[str, list[tuple[str, bool]]], live: list[str]
    ) -> tuple[set[EntryRef], list[str], dict[str, str]]:
        """Keep our entries (`held`: per stream, each id and whether to re-claim it, so that
        its idle time starts again, or only look at it), and read the states of the hashes of
        the jobs `live` (a cancel whose announcement we missed). Returns the entries that are
        no longer ours (claimed by another consumer, or acknowledged), the states, and the
        streams whose key holds another type (each with the error: their entries are left
        as they were)."""
        pipe = self.redis.pipeline(transaction=False)
        asked: list[str] = []
        for stream, entries in held.items():
            for start in range(0, len(entries), WRITE_BATCH):
                args: list[Any] = [self.group, self.consumer]
                for entry_id, claim in entries[start : start + WRITE_BATCH]:
                    args += [1 if claim else 0, entry_id]
                pipe.eval(codec.HOLD_SCRIPT, 1, stream, *args)
                asked.append(stream)
        for job_id in live:
            pipe.hget(codec.job_key(job_id), "state")
        answers = pipe.execute(raise_on_error=False)
        gone: set[EntryRef] = set()
        wrong: dict[str, str] = {}
        for stream, answer in zip(asked, answers, strict=False):
            if isinstance(answer, Exception):
                if wrong_type(answer):  # that stream alone
                    wrong[stream] = str(answer)
                    continue
                raise answer  # NOGROUP, a lost connection...: the caller retries
            gone.update((stream, entry_id.decode()) for entry_id in answer)
        return gone, [_state(state) for state in answers[len(asked) :]], wrong

    def trim(self, stream: str) -> int:
        """Delete the jobs stream's entries acknowledged over `retention` ago and trim the
        results stream to about `retention`; how many entries were deleted."""
        now_ms = int(time.time() * 1000)
        cutoff = max(0, now_ms - self.retention_ms)
        keys = [codec.acked_set(stream), stream, self.results]
        deleted = 0
        while True:
            done: Any = self.redis.eval(
                codec.TRIM_SCRIPT, len(keys), *keys, cutoff, TRIM_PAGE, f"{cutoff}-0"
            )
            deleted += int(done)
            if int(done) < TRIM_PAGE:
                return deleted

    def claim(self, stream: str, count: int) -> list[Entry]:
        """Up to `count` entries of `stream` idle past `claim_after` on another consumer (a
        controller that stopped, or one that cannot run them). Our own are never claimed
        here: what this controller holds but does not keep fresh is left for the others."""
        start = self._claim_cursor.get(stream, "-")
        page: Any = self.redis.xpending_range(
            stream, self.group, start, "+", CLAIM_PAGE, idle=self.claim_after_ms
        )
        mine = self.consumer.encode()
        ids: list[Any] = []
        last = ""
        for pending in page:
            last = pending["message_id"].decode()
            if pending["consumer"] not in (mine, self.consumer):
                ids.append(last)
                if len(ids) == count:
                    break
        more = len(ids) == count or len(page) == CLAIM_PAGE
        self._claim_cursor[stream] = f"({last}" if more and last else "-"
        if not ids:
            return []
        # XCLAIM with the same minimum idle time: one claimed meanwhile is left where it is.
        raw: Any = self.redis.xclaim(stream, self.group, self.consumer, self.claim_after_ms, ids)
        entries = self.with_states(stream, raw)
        if entries:
            log.info(
                "redis: claimed %d entries of %r idle for over %g s (a controller stopped?)",
                len(entries),
                stream,
                self.settings.claim_after,
            )
        return entries

    def group_info(self, stream: str) -> tuple[int | None, int | None]:
        for group in self.redis.xinfo_groups(stream):
            name = group.get("name")
            if name in (self.group, self.group.encode()):
                return group.get("lag"), group.get("pending")
        return None, None

    @staticmethod
    def heard(pubsub: Any) -> list[tuple[str, str]]:
        """(channel, job id) of each announcement heard within a second."""
        message = pubsub.get_message(timeout=1.0)
        heard = []
        while message is not None:
            if message.get("type") == "message":
                channel = message["channel"].decode("utf-8", "replace")
                heard.append((channel, message["data"].decode("utf-8", "replace")))
            message = pubsub.get_message(timeout=0)
        return heard


def wrong_type(exc: BaseException | str) -> bool:
    """Whether a Redis error says a key holds another type than the command works on: the
    fault of that key alone (its stream, its hash), not of Redis or the connection."""
    return "WRONGTYPE" in str(exc)


def _text(answer: Any) -> str:
    """An error as a script gives it back (bytes, or already text)."""
    if isinstance(answer, bytes):
        return answer.decode("utf-8", "replace")
    return str(answer)


def _state(answer: Any) -> str:
    """A job hash's `state` as read in a pipeline: "" for none, WRONG_TYPE for a key that
    is not a hash."""
    if isinstance(answer, Exception):
        return codec.WRONG_TYPE if "WRONGTYPE" in str(answer) else ""
    return answer.decode("utf-8", "replace") if answer else ""
