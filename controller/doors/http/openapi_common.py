"""What the OpenAPI document's parts share (controller/doors/http/openapi.py and the modules
beside it): the Error object's reference, the error answers, a JSON answer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ERROR = {"$ref": "#/components/schemas/Error"}
# What the answers every route may give say.
COMMON_WHY = {
    401: "a bearer token is needed (http_token_file is set)",
    403: "the source address is not in allowed_clients",
    429: "10 wrong tokens from this address within a minute: it waits a minute",
    503: "the journal cannot record now, or the jobs not yet ended would go past "
    "max_pending or max_pending_bytes; try again after Retry-After seconds",
}


def error_answers(why: Mapping[int, str], codes: tuple[int, ...]) -> dict[str, Any]:
    """The error answers `codes`, each the Error object with its `why` (or COMMON_WHY); where a
    token is asked for (401), also 429 (too many wrong tokens from this address)."""
    if 401 in codes and 429 not in codes:
        codes = (*codes, 429)
    answers: dict[str, Any] = {}
    for code in codes:
        answer: dict[str, Any] = {
            "description": why.get(code) or COMMON_WHY[code],
            "content": {"application/json": {"schema": ERROR}},
        }
        if code in (429, 503):
            answer["headers"] = {
                "Retry-After": {
                    "description": "seconds to wait before asking again",
                    "schema": {"type": "integer", "minimum": 0},
                }
            }
        answers[str(code)] = answer
    return answers


def json_answer(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}
