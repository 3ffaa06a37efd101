"""The Redis stream door's calls to Redis, and the arguments and answers of its scripts.

The door's busy calls, the scripts of controller/streams.py that read new
entries and write outcomes, go through a link (controller/shell/redis_link.py);
this class builds their arguments and reads their answers. Its other calls
(blocking reads, claims, group set-up, lag) are blocking redis-py calls that
`controller/shell/redis_door.py` runs in a worker thread. It holds the
connection pool and no state of the door's (what it holds, what waits to be
written): arguments in, answers out. The one exception is the XAUTOCLAIM
cursor, which only the door's keeper task moves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from controller import streams
from controller.config import RedisSettings

log = logging.getLogger("controller.redis")

# How long one XREADGROUP waits for new entries (ms); also bounds a shutdown's wait.
READ_BLOCK_MS = 1000
# Outcomes written per round trip, at most (and entries read per page of our own).
WRITE_BATCH = 500
# Acknowledged entries deleted per script call (each call holds Redis for its page).
TRIM_PAGE = 1000


@dataclass(frozen=True, slots=True)
class Outcome:
    state: str
    result: bytes
    error: str


@dataclass(frozen=True, slots=True)
class Entry:
    entry_id: str
    fields: dict[bytes, bytes]
    hash_state: str  # the state its job:<id> hash has ("" when none)
    job_id: str


class StreamCalls:
    """One consumer's blocking calls on one stream and group."""

    def __init__(
        self, settings: RedisSettings, consumer: str, retention_ms: int, claim_after_ms: int
    ) -> None:
        self.settings = settings
        self.stream = settings.stream
        self.group = settings.group
        self.consumer = consumer
        self.retention_ms = retention_ms
        self.acked = streams.acked_set(self.stream)
        self.claim_after_ms = claim_after_ms
        # ValueError for a URL redis-py cannot use (the door turns it into a StartupError).
        self.redis = redis.Redis.from_url(
            settings.url, socket_connect_timeout=5, socket_timeout=READ_BLOCK_MS / 1000 + 10
        )
        self._claim_cursor = "0-0"

    def close(self) -> None:
        self.redis.close()

    def pubsub(self) -> Any:
        return self.redis.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]

    def ensure_group(self) -> None:
        try:
            self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
            log.info("redis: created group %r on stream %r", self.group, self.stream)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read_own(self, start: str) -> tuple[list[Entry], str]:
        """A page of our pending entries after `start`, and the last id on it ("" at the end).
        Entries deleted from the stream while pending are acknowledged here."""
        answer: Any = self.redis.xreadgroup(
            self.group, self.consumer, {self.stream: start}, count=WRITE_BATCH
        )
        raw = answer[0][1] if answer else []
        if not raw:
            return [], ""
        # redis-py gives an entry deleted from the stream as no fields (an entry has >= 1).
        deleted = [entry_id for entry_id, fields in raw if not fields]
        if deleted:
            self.redis.xack(self.stream, self.group, *deleted)
        return self.with_states(raw), raw[-1][0].decode()

    def read_request(self, count: int) -> tuple[list[Any], list[Any]]:
        """Keys and arguments of `streams.READ_SCRIPT`: up to `count` new entries, no waiting."""
        return [self.stream], [self.group, self.consumer, count]

    def entries_of(self, waiting: Sequence[Any]) -> list[Entry]:
        """The entries in an answer of `streams.READ_SCRIPT`."""
        entries = []
        for entry_id, flat, state in waiting:
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            eid = entry_id.decode()
            entries.append(Entry(eid, fields, state.decode(), self.job_id(eid, fields)))
        return entries

    def read_blocking(self, count: int) -> list[Entry]:
        """New entries, waiting up to READ_BLOCK_MS for the first; then their hashes' states
        (a second round trip)."""
        answer: Any = self.redis.xreadgroup(
            self.group, self.consumer, {self.stream: ">"}, count=count, block=READ_BLOCK_MS
        )
        return self.with_states(answer[0][1] if answer else [])

    def with_states(self, raw: Sequence[tuple[Any, Any]]) -> list[Entry]:
        """Entries with their job's id and the state of its hash (one round trip)."""
        entries = []
        for entry_id, fields in raw:
            if not fields:  # deleted from the stream while pending (redis-py: {} or None)
                continue
            eid = entry_id.decode()
            entries.append(Entry(eid, fields, "", self.job_id(eid, fields)))
        if not entries:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for entry in entries:
            pipe.hget(streams.job_key(entry.job_id), "state")
        # A `job:<id>` of another type fails its entry alone, not the read.
        states = pipe.execute(raise_on_error=False)
        return [
            Entry(e.entry_id, e.fields, _state(s), e.job_id)
            for e, s in zip(entries, states, strict=True)
        ]

    def job_id(self, entry_id: str, fields: dict[bytes, bytes]) -> str:
        given = fields.get(b"id")
        if given:
            return given.decode("utf-8", "replace")
        return streams.entry_job_id(self.stream, entry_id)

    def outcomes_request(
        self, outcomes: dict[str, Outcome], acks: dict[str, list[str]], stamp: str
    ) -> tuple[list[Any], list[Any]]:
        """Keys and arguments of `streams.OUTCOMES_SCRIPT` for these outcomes and entries."""
        keys = [streams.results_stream(self.stream), self.stream, self.acked]
        now_ms = int(time.time() * 1000)
        oldest = f"{max(0, now_ms - self.retention_ms)}-0"
        args: list[Any] = [self.group, stamp, self.retention_ms, oldest, now_ms]
        for job_id, outcome in outcomes.items():
            keys.append(streams.job_key(job_id))
            acked = acks[job_id]
            # surrogatepass: an error text may hold a lone surrogate (legal in JSON, not UTF-8).
            error = outcome.error.encode("utf-8", "surrogatepass")
            args += [job_id, outcome.state, outcome.result, error, len(acked), *acked]
        return keys, args

    def refresh(self, held: list[str], live: list[str]) -> list[str]:
        """Re-claim our entries for ourselves (their idle time starts again), and read the
        states of our live jobs' hashes (a cancel whose announcement we missed)."""
        pipe = self.redis.pipeline(transaction=False)
        for start in range(0, len(held), WRITE_BATCH):
            chunk: list[Any] = held[start : start + WRITE_BATCH]
            pipe.xclaim(self.stream, self.group, self.consumer, 0, chunk, justid=True)
        for job_id in live:
            pipe.hget(streams.job_key(job_id), "state")
        answers = pipe.execute(raise_on_error=False)
        for answer in answers[: len(answers) - len(live)]:
            if isinstance(answer, Exception):  # a claim failed (NOGROUP...): the caller retries
                raise answer
        return [_state(state) for state in answers[len(answers) - len(live) :]]

    def trim(self) -> int:
        """Delete the jobs stream's entries acknowledged over `retention` ago and trim the
        results stream to about `retention`; how many entries were deleted."""
        now_ms = int(time.time() * 1000)
        cutoff = max(0, now_ms - self.retention_ms)
        keys = [self.acked, self.stream, streams.results_stream(self.stream)]
        deleted = 0
        while True:
            done: Any = self.redis.eval(
                streams.TRIM_SCRIPT, len(keys), *keys, cutoff, TRIM_PAGE, f"{cutoff}-0"
            )
            deleted += int(done)
            if int(done) < TRIM_PAGE:
                return deleted

    def claim(self, count: int) -> list[Entry]:
        """Entries idle past `claim_after` on another consumer: a controller that stopped."""
        cursor, raw, *_ = self.redis.xautoclaim(
            self.stream,
            self.group,
            self.consumer,
            self.claim_after_ms,
            start_id=self._claim_cursor,
            count=count,
        )
        self._claim_cursor = cursor.decode() if isinstance(cursor, bytes) else str(cursor)
        entries = self.with_states(raw)
        if entries:
            log.info(
                "redis: claimed %d entries idle for over %g s (a controller stopped?)",
                len(entries),
                self.settings.claim_after,
            )
        return entries

    def group_info(self) -> tuple[int | None, int | None]:
        for group in self.redis.xinfo_groups(self.stream):
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


def _state(answer: Any) -> str:
    """A job hash's `state` as read in a pipeline: "" for none, WRONG_TYPE for a key that
    is not a hash."""
    if isinstance(answer, Exception):
        return streams.WRONG_TYPE if "WRONGTYPE" in str(answer) else ""
    return answer.decode("utf-8", "replace") if answer else ""
