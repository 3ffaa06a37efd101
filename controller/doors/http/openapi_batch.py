"""Batches in the OpenAPI document (controller/doors/http/openapi.py): `POST /batch/` and
`GET /batch/{batch_id}/` (DESIGN.md section 17), merged into its paths."""

from __future__ import annotations

from typing import Any

from controller.doors.http.codec import MAX_BULK
from controller.doors.http.openapi_common import error_answers, json_answer
from controller.job_states import JobState

_JOB = {"$ref": "#/components/schemas/Job"}
_NEW = {"$ref": "#/components/schemas/NewJob"}
_WHY = {
    400: "malformed JSON, or a bad job (`job N` names the first bad one of `jobs`, `then:` the "
    "then job); nothing is made",
    404: "no such batch (or its then job was forgotten)",
    409: "the then job's id exists already",
    413: f"a payload over max_extra_size, or more than {MAX_BULK} jobs",
}


def _errors(*codes: int) -> dict[str, Any]:
    return error_answers(_WHY, codes)


_BATCH_ID = {"name": "batch_id", "in": "path", "required": True, "schema": {"type": "string"}}
_NEW_THEN = {
    "allOf": [_NEW],
    "description": "the then job (its after and after_any are the batch's: not given)",
}

BATCH_PATHS: dict[str, Any] = {
    "/batch/": {
        "post": {
            "summary": "a batch: its jobs (as a bulk array) and a then job that runs once they "
            "have all ended, whatever their outcomes (journaled first)",
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": ["jobs", "then"],
                            "additionalProperties": False,
                            "properties": {
                                "jobs": {"type": "array", "maxItems": MAX_BULK, "items": _NEW},
                                "then": _NEW_THEN,
                            },
                        }
                    }
                },
            },
            "responses": {
                "201": json_answer(
                    {
                        "type": "object",
                        "required": ["id", "jobs", "then"],
                        "properties": {
                            "id": {"type": "string"},
                            "jobs": {"type": "array", "items": _JOB},
                            "then": _JOB,
                        },
                    },
                    "the batch: its id, its jobs in order, its then job (waiting)",
                ),
                **_errors(400, 401, 403, 409, 413, 503),
            },
        }
    },
    "/batch/{batch_id}/": {
        "parameters": [_BATCH_ID],
        "get": {
            "summary": "a batch's jobs counted by state, their ids and its then job's id",
            "responses": {
                "200": json_answer(
                    {
                        "type": "object",
                        "required": ["id", "counts", "ids", "then"],
                        "properties": {
                            "id": {"type": "string"},
                            "counts": {
                                "type": "object",
                                "additionalProperties": {"type": "integer", "minimum": 1},
                                "description": "states: "
                                + ", ".join(state.value for state in JobState),
                            },
                            "ids": {"type": "array", "items": {"type": "string"}},
                            "then": {"type": "string"},
                        },
                    },
                    "the batch",
                ),
                **_errors(401, 403, 404),
            },
        },
    },
}
