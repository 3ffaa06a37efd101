"""A job's options (queue, priority, labels, time, retries), one reader for every door. Pure.

Every door takes the same options: the UDP door from `params`, the HTTP door from the
`POST /job/` body (JSON values), the Redis door from an entry's fields (text). `parse`
reads either form and checks every value; a bad one raises `BadOption`, which each door
turns into its own refusal (an error ack, a 400, a `failed` outcome). The result is a
`JobOptions` with every default already resolved, so the scheduler, the journal and the
job object read one record. Jobs that give no option share their door's defaults object:
most jobs cost nothing for options.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from controller.joblimits import NO_LIMITS, JobLimits, LimitError, parse_limits

DEFAULT_QUEUE = "default"
NAME_RULE = "[a-z0-9_.-]{1,64}"
_NAME = re.compile(r"[a-z0-9_.-]{1,64}")
MIN_PRIORITY = -100
MAX_PRIORITY = 100
MAX_JOB_RETRIES = 100
# How long a retry may wait at most, however often it doubled.
MAX_RETRY_DELAY = 3600.0
# Times further away than this (3,650 days) are a mistake, not a plan; the bound keeps every
# sum finite and every time a job may wait within the years a date can show.
MAX_SECONDS = 3650 * 86400.0
MAX_LABELS = 32
MAX_OWNER = 200
_OWNER_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:~@+=-")
# A unique key (DESIGN.md section 17): text a person can read and put in a URL or a log line,
# one space for every queue and door.
MAX_UNIQUE_KEY = 200
_UNIQUE_KEY_CHARS = _OWNER_CHARS | frozenset("/#")
UNIQUE_KEY_PATTERN = f"^[A-Za-z0-9._:~@+=/#-]{{1,{MAX_UNIQUE_KEY}}}$"
UNIQUE_KEY_RULE = (
    f"unique_key must be 1 to {MAX_UNIQUE_KEY} of the characters "
    "A-Z a-z 0-9 and . _ : ~ @ + = - / #"
)

# Dependencies (DESIGN.md section 17): a job waits for at most this many others, each named
# by an id of at most MAX_AFTER_ID characters.
MAX_AFTER = 100
MAX_AFTER_ID = 200

# Every option, in the order the documents list them.
OPTIONS = (
    "queue",
    "priority",
    "requires",
    "delay",
    "run_at",
    "max_retries",
    "retry_delay",
    "timeout",
    "placement_timeout",
    "owner",
    "limits",
    "unique_key",
    "after",
    "after_any",
)
OPTION_NAMES = frozenset(OPTIONS)


class BadOption(ValueError):
    """An option's value is refused; the message names the option and says why."""


@dataclass(frozen=True, slots=True)
class JobOptions:
    """A job's options, defaults resolved. Times are seconds; `run_at` is wall-clock seconds
    (None: as soon as a worker is free)."""

    queue: str = DEFAULT_QUEUE
    priority: int = 0
    requires: frozenset[str] = frozenset()
    run_at: float | None = None
    max_retries: int = 3
    retry_delay: float = 0.0
    timeout: float = 0.0  # 0: no limit
    placement_timeout: float = 0.0  # 0: no limit
    owner: str = ""
    # Ceilings for each attempt (DESIGN.md section 15): the configuration's job_limits, lowered
    # by what the job asked for.
    limits: JobLimits = NO_LIMITS
    # While a job with this key has not ended, a submission with it makes nothing and answers
    # that job (DESIGN.md section 17; the job desk keeps the rule). "": none.
    unique_key: str = ""
    # The jobs it waits for (state `waiting`) before it is queued, and whether it runs whatever
    # their outcomes (False: one that failed or was canceled cancels it). The job desk keeps the
    # rule (controller/shell/waits.py).
    after: tuple[str, ...] = ()
    after_any: bool = False
    # The batch whose `then` job this is (POST /batch/: it waits for the batch's jobs, its
    # `after`, as after_any). "": none. Not an option a submission gives.
    batch: str = ""

    def retry_wait(self, failures: int, jitter: float) -> float:
        """Seconds before the retry that follows the `failures`-th failure: `retry_delay`
        doubled at each further one, at most MAX_RETRY_DELAY, times `jitter` (0.8..1.2)."""
        if self.retry_delay <= 0:
            return 0.0
        base = self.retry_delay * 2.0 ** min(max(failures - 1, 0), 32)
        return min(base, MAX_RETRY_DELAY) * jitter


DEFAULT = JobOptions()


def valid_name(name: object) -> bool:
    """A queue or label name: 1 to 64 of a-z 0-9 _ . -"""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def _number(name: str, value: Any, text: bool, *, upper: float) -> float:
    if text and isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise BadOption(f"{name} must be a number of seconds, got {value[:40]!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadOption(f"{name} must be a number of seconds, got {type(value).__name__}")
    # An integer is compared as it is: float() of a huge one raises.
    if (value < 0) if isinstance(value, int) else not (math.isfinite(value) and value >= 0):
        raise BadOption(f"{name} must be a number of seconds from 0, got {_shown(value)}")
    if value > upper:
        raise BadOption(f"{name} must be at most {upper:.0f} seconds, got {_shown(value)}")
    return float(value)


def _shown(value: object) -> str:
    """A refused value as a message shows it, short (a number of a thousand digits is not
    repeated, nor can Python write one of more than 4,300)."""
    if isinstance(value, int) and not -(10**30) < value < 10**30:
        return "a number of more than 30 digits"
    if isinstance(value, list | dict):
        return type(value).__name__
    return repr(value)[:60]


def _integer(name: str, value: Any, text: bool, low: int, high: int) -> int:
    if text and isinstance(value, str):
        stripped = value.strip()
        if not re.fullmatch(r"[+-]?[0-9]{1,4}", stripped):
            raise BadOption(f"{name} must be an integer from {low} to {high}, got {value[:40]!r}")
        value = int(stripped)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadOption(f"{name} must be an integer from {low} to {high}, got {_shown(value)}")
    return value


def _labels(value: Any, text: bool) -> frozenset[str]:
    if text and isinstance(value, str):
        value = [part.strip() for part in value.split(",")] if value.strip() else []
    if not isinstance(value, list):
        raise BadOption(f"requires must be a list of labels, got {type(value).__name__}")
    if len(value) > MAX_LABELS:
        raise BadOption(f"requires names at most {MAX_LABELS} labels, got {len(value)}")
    for label in value:
        if not valid_name(label):
            raise BadOption(f"a label must match {NAME_RULE}, got {_shown(label)}")
    return frozenset(value)


def parse_time(value: Any) -> float:
    """An RFC 3339 time (with a zone offset) as wall-clock seconds."""
    if not isinstance(value, str):
        raise BadOption(f"run_at must be an RFC 3339 time as text, got {type(value).__name__}")
    try:
        moment = datetime.fromisoformat(value.strip())
        if moment.tzinfo is None:
            raise BadOption(f"run_at needs a zone offset (Z or +HH:MM): {value[:60]!r}")
        return moment.timestamp()
    except (ValueError, OverflowError) as exc:
        if isinstance(exc, BadOption):
            raise
        raise BadOption(f"run_at is not an RFC 3339 time: {value[:60]!r}") from None


def parse(
    fields: Mapping[str, Any], defaults: JobOptions, now_wall: float, *, text: bool = False
) -> JobOptions:
    """The options among `fields` (other keys are ignored), over `defaults`. `text`: values
    come as text (Redis fields, command lines): numbers are read from it and `requires` is
    comma separated. Raises BadOption."""
    given = [name for name in fields if name in OPTION_NAMES]
    if not given:
        return defaults
    changes: dict[str, Any] = {}
    if "queue" in fields:
        queue = fields["queue"]
        if not valid_name(queue):
            raise BadOption(f"queue must match {NAME_RULE}, got {_shown(queue)}")
        changes["queue"] = queue
    if "priority" in fields:
        changes["priority"] = _integer(
            "priority", fields["priority"], text, MIN_PRIORITY, MAX_PRIORITY
        )
    if "requires" in fields:
        changes["requires"] = _labels(fields["requires"], text)
    if "delay" in fields and "run_at" in fields:
        raise BadOption("give delay or run_at, not both")
    if "delay" in fields:
        delay = _number("delay", fields["delay"], text, upper=MAX_SECONDS)
        changes["run_at"] = now_wall + delay if delay > 0 else None
    if "run_at" in fields:
        run_at = parse_time(fields["run_at"])
        if run_at - now_wall > MAX_SECONDS:
            raise BadOption(
                f"run_at must be at most {MAX_SECONDS / 86400:g} days ahead,"
                f" got {fields['run_at'][:60]!r}"
            )
        changes["run_at"] = run_at if run_at > now_wall else None
    if "max_retries" in fields:
        changes["max_retries"] = _integer(
            "max_retries", fields["max_retries"], text, 0, MAX_JOB_RETRIES
        )
    for name, upper in (
        ("retry_delay", MAX_RETRY_DELAY),
        ("timeout", MAX_SECONDS),
        ("placement_timeout", MAX_SECONDS),
    ):
        if name in fields:
            changes[name] = _number(name, fields[name], text, upper=upper)
    if "owner" in fields:
        owner = fields["owner"]
        if (
            not isinstance(owner, str)
            or not 0 < len(owner) <= MAX_OWNER
            or not set(owner) <= _OWNER_CHARS
        ):
            raise BadOption(
                f"owner must be 1 to {MAX_OWNER} of the characters A-Z a-z 0-9 and . _ : ~ @ + = -"
            )
        changes["owner"] = owner
    if "limits" in fields:
        changes["limits"] = _limits(fields["limits"], defaults.limits, text)
    if "unique_key" in fields:
        changes["unique_key"] = unique_key(fields["unique_key"])
    if "after" in fields:
        changes["after"] = _after(fields["after"], text)
    if "after_any" in fields:
        changes["after_any"] = _flag("after_any", fields["after_any"], text)
    return replace(defaults, **changes)


def _after(value: Any, text: bool) -> tuple[str, ...]:
    """The job ids of `after`: a list (as text: comma separated) of at most MAX_AFTER, each
    named once. Whether they name jobs the controller holds is the job desk's to check."""
    if text and isinstance(value, str):
        value = [part.strip() for part in value.split(",")] if value.strip() else []
    if not isinstance(value, list):
        raise BadOption(f"after must be a list of job ids, got {type(value).__name__}")
    if len(value) > MAX_AFTER:
        raise BadOption(f"after names at most {MAX_AFTER} jobs, got {len(value)}")
    for job_id in value:
        if not isinstance(job_id, str) or not 0 < len(job_id) <= MAX_AFTER_ID:
            raise BadOption(
                f"after: a job id is text of 1 to {MAX_AFTER_ID} characters, got {_shown(job_id)}"
            )
    return tuple(dict.fromkeys(value))


def _flag(name: str, value: Any, text: bool) -> bool:
    if text and isinstance(value, str) and value.strip().lower() in ("true", "1", "false", "0"):
        return value.strip().lower() in ("true", "1")
    if not isinstance(value, bool):
        raise BadOption(f"{name} must be true or false, got {_shown(value)}")
    return value


def unique_key(value: Any) -> str:
    """A job's `unique_key`, checked (BadOption when it breaks UNIQUE_KEY_RULE)."""
    if (
        not isinstance(value, str)
        or not 0 < len(value) <= MAX_UNIQUE_KEY
        or not set(value) <= _UNIQUE_KEY_CHARS
    ):
        raise BadOption(f"{UNIQUE_KEY_RULE}, got {_shown(value)}")
    return value


def _limits(value: Any, ceiling: JobLimits, text: bool) -> JobLimits:
    """A job's `limits`: less than `ceiling` (the configuration's job_limits) may be asked
    for, never more. As text (a Redis field, a command line) it is a JSON object."""
    if text and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise BadOption(
                f'limits must be a JSON object like {{"memory_max": "256M"}}, got {_shown(value)}'
            ) from None
    if isinstance(value, Mapping) and any(limit is None for limit in value.values()):
        raise BadOption("limits: a limit may not be null (leave it out for none)")
    try:
        asked = parse_limits(value)
    except LimitError as exc:
        raise BadOption(f"limits: {str(exc)[:200]}") from None
    over = asked.exceeding(ceiling)
    if over is not None:
        raise BadOption(
            f"limits: {over} {getattr(asked, over):g} is more than the configuration's "
            f"job_limits allow ({getattr(ceiling, over):g})"
        )
    return ceiling.tighter(asked)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_FIRST = datetime.min.replace(tzinfo=UTC)
_LAST = datetime.max.replace(tzinfo=UTC)


def rfc3339(wall: float) -> str:
    """Wall-clock seconds as RFC 3339 in UTC (microseconds, `Z`). Never raises: a time beyond
    the years a date can show (a record an older version kept) is shown as the first or last
    moment of them, and a time that is no number (NaN) as the epoch."""
    try:
        moment = datetime.fromtimestamp(wall, UTC)
    except (OverflowError, ValueError, OSError):
        moment = _clamped(wall)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def _clamped(wall: float) -> datetime:
    if math.isnan(wall):
        return _EPOCH
    try:
        return _EPOCH + timedelta(seconds=wall)
    except OverflowError:
        return _LAST if wall > 0 else _FIRST


def as_fields(options: JobOptions) -> dict[str, Any]:
    """The options as the job object shows them (JSON values)."""
    return {
        "queue": options.queue,
        "priority": options.priority,
        "requires": sorted(options.requires),
        "run_at": rfc3339(options.run_at) if options.run_at is not None else None,
        "max_retries": options.max_retries,
        "retry_delay": options.retry_delay,
        "timeout": options.timeout,
        "placement_timeout": options.placement_timeout,
        "owner": options.owner,
        "limits": options.limits.to_json(),
        "unique_key": options.unique_key or None,
        "after": list(options.after),
        "after_any": options.after_any,
        "batch": options.batch or None,
    }


@functools.lru_cache(maxsize=1024)
def to_json(options: JobOptions) -> str:
    """The options as the journal keeps them (most jobs share a few: kept made)."""
    return json.dumps(
        {
            "queue": options.queue,
            "priority": options.priority,
            "requires": sorted(options.requires),
            "run_at": options.run_at,
            "max_retries": options.max_retries,
            "retry_delay": options.retry_delay,
            "timeout": options.timeout,
            "placement_timeout": options.placement_timeout,
            "owner": options.owner,
            **({"limits": options.limits.to_json()} if not options.limits.is_empty() else {}),
            **({"unique_key": options.unique_key} if options.unique_key else {}),
            **({"after": list(options.after)} if options.after else {}),
            **({"after_any": True} if options.after_any else {}),
            **({"batch": options.batch} if options.batch else {}),
        },
        separators=(",", ":"),
    )


def from_json(text: str, defaults: JobOptions) -> JobOptions:
    """Options the journal kept (what is missing, from an older journal, takes `defaults`)."""
    data = json.loads(text) if text else {}
    if not isinstance(data, dict) or not data:
        return defaults
    run_at = data.get("run_at")
    return JobOptions(
        queue=str(data.get("queue", defaults.queue)),
        priority=int(data.get("priority", defaults.priority)),
        requires=frozenset(str(label) for label in data.get("requires", ())),
        run_at=float(run_at) if run_at is not None else None,
        max_retries=int(data.get("max_retries", defaults.max_retries)),
        retry_delay=float(data.get("retry_delay", defaults.retry_delay)),
        timeout=float(data.get("timeout", defaults.timeout)),
        placement_timeout=float(data.get("placement_timeout", defaults.placement_timeout)),
        owner=str(data.get("owner", defaults.owner)),
        limits=_kept_limits(data.get("limits"), defaults.limits),
        unique_key=str(data.get("unique_key", "")),
        after=tuple(str(job_id) for job_id in data.get("after", ())),
        after_any=bool(data.get("after_any", False)),
        batch=str(data.get("batch", "")),
    )


def _kept_limits(value: Any, defaults: JobLimits) -> JobLimits:
    """The limits a journal kept (none kept, or unreadable: the configuration's)."""
    if value is None:
        return defaults
    try:
        return parse_limits(value)
    except LimitError:
        return defaults
