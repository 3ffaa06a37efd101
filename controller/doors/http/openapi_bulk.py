"""The array form of `POST /job/` in the OpenAPI document (controller/doors/http/openapi.py):
a body or an answer that is one object, or an array of at most MAX_BULK of them."""

from __future__ import annotations

from typing import Any

from controller.doors.http.codec import MAX_BULK

# What the errors of POST /job/ say of an array.
BAD_JOB = (
    "malformed JSON or a bad field (in an array: the message begins `job N` with the first "
    "bad job's 0-based index, and its id when it has one; no job is made)"
)
TOO_LARGE = f"a payload over max_extra_size, or more than {MAX_BULK} jobs in one array"


def one_or_many(schema: dict[str, Any], description: str) -> dict[str, Any]:
    """`schema`, or an array of at most MAX_BULK of it (one job, or several in order)."""
    many = {"type": "array", "maxItems": MAX_BULK, "items": schema, "description": description}
    return {"oneOf": [schema, many]}
