"""The job options' schemas in the OpenAPI document (controller/doors/http/openapi.py): as
`POST /job/` takes them (`OPTIONS_IN`) and as the job object shows them (`OPTIONS_OUT`)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from controller import options
from controller.job_ids import ID_PATTERN

_TEXT = {"type": "string"}
_NAME = {"type": "string", "pattern": "^" + options.NAME_RULE + "$"}
_SECONDS = {"type": "number", "minimum": 0, "maximum": options.MAX_SECONDS}


def _years_through(last: int) -> str:
    """A pattern for an RFC 3339 time whose year is at most `last` (1000..9999)."""
    digits = str(last)
    parts = [
        digits[:i] + f"[0-{int(digits[i]) - 1}]" + "[0-9]" * (3 - i)
        for i in range(4)
        if digits[i] != "0"
    ]
    return "^(?:" + "|".join([*parts, digits]) + ")-"


# run_at: at most 3,650 days ahead, described by its year: until the end of the year 8 years
# after the document was made (within those days, whatever the day it was made).
_RUN_AT = {
    "type": "string",
    "format": "date-time",
    "pattern": _years_through(datetime.now(UTC).year + 8),
}
# The job options, as POST /job/ takes them.
# A job's `limits` (DESIGN.md section 15): bytes, or a number with a K, M or G suffix.
_LIMIT_SIZE: dict[str, Any] = {
    "oneOf": [
        {"type": "integer", "minimum": 1, "maximum": 2**62},
        {"type": "string", "pattern": "^[1-9][0-9]{0,8}[KMG]?$"},
    ]
}
_LIMIT_COUNT: dict[str, Any] = {"type": "integer", "minimum": 1, "maximum": 2**31 - 1}
OPTIONS_IN: dict[str, Any] = {
    "queue": _NAME,
    "priority": {
        "type": "integer",
        "minimum": options.MIN_PRIORITY,
        "maximum": options.MAX_PRIORITY,
    },
    "requires": {"type": "array", "items": _NAME, "maxItems": options.MAX_LABELS},
    "delay": _SECONDS,
    "run_at": _RUN_AT,
    "max_retries": {"type": "integer", "minimum": 0, "maximum": options.MAX_JOB_RETRIES},
    "retry_delay": {"type": "number", "minimum": 0, "maximum": options.MAX_RETRY_DELAY},
    "timeout": _SECONDS,
    "placement_timeout": _SECONDS,
    "owner": {"type": "string", "pattern": ID_PATTERN},
    "unique_key": {"type": "string", "pattern": options.UNIQUE_KEY_PATTERN},
    "after": {
        "type": "array",
        "items": {"type": "string", "minLength": 1, "maxLength": options.MAX_AFTER_ID},
        "maxItems": options.MAX_AFTER,
    },
    "after_any": {"type": "boolean"},
    "limits": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "memory_max": _LIMIT_SIZE,
            "tasks_max": _LIMIT_COUNT,
            "cpu_time": {"type": "number", "minimum": 0.001, "maximum": 365 * 86400},
            "file_size": _LIMIT_SIZE,
            "open_files": _LIMIT_COUNT,
            "cpu_quota": {"type": "number", "minimum": 0.01, "maximum": 4096},
        },
    },
}
# The same in the job object (run_at: when it is or was due, or null).
OPTIONS_OUT: dict[str, Any] = {
    **{name: OPTIONS_IN[name] for name in ("queue", "priority", "requires", "max_retries")},
    "run_at": {"type": "string", "format": "date-time", "nullable": True},
    **{name: {"type": "number", "minimum": 0} for name in ("retry_delay", "timeout")},
    "placement_timeout": {"type": "number", "minimum": 0},
    "owner": _TEXT,
    "limits": {"type": "object", "additionalProperties": {"type": "number"}},
    "unique_key": {"type": "string", "nullable": True},
    "after": {"type": "array", "items": _TEXT},
    "after_any": {"type": "boolean"},
    "batch": {"type": "string", "nullable": True},
}
