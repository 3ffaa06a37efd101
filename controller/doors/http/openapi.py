"""`GET /openapi.json`: the OpenAPI 3 document of the HTTP job API (written by hand, and
checked against the live server by tests/test_http_schema.py with schemathesis)."""

from __future__ import annotations

from typing import Any

from controller import options
from controller.declared import MAX_NAME_CHARS, MAX_NAMES
from controller.doors.http import codec, events
from controller.doors.http.openapi_batch import BATCH_PATHS
from controller.doors.http.openapi_bulk import BAD_JOB, TOO_LARGE, one_or_many
from controller.doors.http.openapi_common import ERROR, error_answers, json_answer
from controller.doors.http.openapi_options import OPTIONS_IN, OPTIONS_OUT
from controller.doors.http.openapi_progress import PROGRESS_IN, PROGRESS_OUT, PROGRESS_RULES
from controller.job_ids import ID_PATTERN, MAX_ID_LENGTH, MAX_TEXT
from controller.job_states import JobState
from controller.options import NAME_RULE

_ERROR = ERROR  # the Error object, as the schemas below name it


def _errors(*codes: int) -> dict[str, Any]:
    """The error answers `codes` (and 429 with 401: openapi_common.py)."""
    return error_answers(_WHY, codes)


_WHY = {
    400: BAD_JOB,
    404: "no such job or path",
    409: "a change the job's state does not allow",
    413: TOO_LARGE,
}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return json_answer(schema, description)


_JOB = {"$ref": "#/components/schemas/Job"}
_NEW = {"$ref": "#/components/schemas/NewJob"}
_QUEUE = {"$ref": "#/components/schemas/Queue"}
_JOB_ID = {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}
_WAIT = {
    "name": "wait",
    "in": "query",
    "required": False,
    "description": "seconds to wait for an answer",
    "schema": {"type": "number", "minimum": 0, "maximum": codec.MAX_WAIT},
}
_TEXT = {"type": "string"}
# A poller's queues or labels: up to MAX_NAMES names, comma separated (the two lists
# together at most MAX_NAME_CHARS characters of names: each half of it here).
_NAMES = f"^({NAME_RULE}(,{NAME_RULE}){{0,{MAX_NAMES - 1}}})?$"


def _declared(name: str, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "description": description,
        "schema": {"type": "string", "pattern": _NAMES, "maxLength": MAX_NAME_CHARS // 2},
    }


_SHORT = {"type": "string", "maxLength": MAX_TEXT}
_NAME = {"type": "string", "pattern": "^" + options.NAME_RULE + "$"}
_SECONDS = {"type": "number", "minimum": 0, "maximum": options.MAX_SECONDS}


_QUEUE_NAME = {"name": "name", "in": "path", "required": True, "schema": _NAME}
# A queue's limits (null: none).
_CONCURRENCY = {"type": "integer", "minimum": 1, "maximum": 1_000_000_000, "nullable": True}
_RATE = {"type": "string", "pattern": "^[1-9][0-9]{0,8}/[sm]$", "nullable": True}

OPENAPI: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {
        "title": "job controller HTTP job API",
        "version": "1",
        "description": "Jobs from every door (UDP, HTTP, Redis) and the workers that run them.",
    },
    "paths": {
        "/health/": {
            "get": {
                "summary": "uptime, live workers of every kind, pending jobs",
                "responses": {
                    "200": _json({"$ref": "#/components/schemas/Health"}, "the controller lives"),
                    **_errors(403),
                },
            }
        },
        "/job/": {
            "get": {
                "summary": "jobs keyed by id, newest first",
                "parameters": [
                    {
                        "name": "state",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "enum": [s.value for s in JobState]},
                    },
                    {
                        "name": "limit",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 1, "maximum": codec.MAX_LIMIT},
                    },
                    {"name": "queue", "in": "query", "required": False, "schema": _NAME},
                ],
                "responses": {
                    "200": _json(
                        {"type": "object", "additionalProperties": _JOB}, "jobs keyed by id"
                    ),
                    **_errors(400, 401, 403),
                },
            },
            "post": {
                "summary": "add a job, or an array of them, all made or none (journaled first)",
                "requestBody": {
                    "required": False,
                    "content": {"application/json": {"schema": one_or_many(_NEW, "jobs")}},
                },
                "responses": {
                    "201": _json(one_or_many(_JOB, "its jobs in order"), "the new job(s)"),
                    "200": _json(one_or_many(_JOB, "each job exists"), "its id exists: it"),
                    **_errors(400, 401, 403, 413, 503),
                },
            },
        },
        "/job/{job_id}/": {
            "parameters": [_JOB_ID],
            "get": {
                "summary": "one job; with ?wait= as soon as it ended or the time is up",
                "parameters": [_WAIT],
                "responses": {"200": _json(_JOB, "the job"), **_errors(400, 401, 403, 404)},
            },
            "put": {
                "summary": "cancel it, append to its log, or (a poller) report on it",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Update"}}
                    },
                },
                "responses": {
                    "200": _json(_JOB, "the job, changed"),
                    **_errors(400, 401, 403, 404, 409, 413),
                },
            },
            "delete": {
                "summary": "soft delete (canceled first if it runs)",
                "responses": {"200": _json(_JOB, "the job, deleted"), **_errors(401, 403, 404)},
            },
        },
        "/job/{job_id}/retry/": {
            "parameters": [_JOB_ID],
            "post": {
                "summary": "a failed or canceled job back to pending, with a fresh max_retries",
                "responses": {
                    "200": _json(_JOB, "the job, pending again"),
                    **_errors(401, 403, 404, 409),
                },
            },
        },
        "/job/{job_id}/output/": {
            "parameters": [_JOB_ID],
            "get": {
                "summary": "what the job wrote to stderr (the newest output_retention bytes)",
                "parameters": [
                    {
                        "name": "follow",
                        "in": "query",
                        "required": False,
                        "description": "1: stream it (chunked) as it comes, until the job ends",
                        "schema": {"type": "string", "enum": ["0", "1"]},
                    }
                ],
                "responses": {
                    "200": {
                        "description": "the output as UTF-8 text (other bytes replaced)",
                        "content": {"text/plain": {"schema": _TEXT}},
                    },
                    **_errors(400, 401, 403, 404),
                },
            },
        },
        "/events/": events.openapi_path(_errors),
        "/queue/": {
            "get": {
                "summary": "every queue that has jobs, workers, a pause or a limit",
                "responses": {
                    "200": _json(
                        {"type": "object", "additionalProperties": _QUEUE}, "queues by name"
                    ),
                    **_errors(401, 403),
                },
            }
        },
        "/queue/{name}/": {
            "parameters": [_QUEUE_NAME],
            "put": {
                "summary": "pause or resume the queue, or set its limits (journaled)",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "additionalProperties": False,
                                "minProperties": 1,
                                "properties": {
                                    "paused": {"type": "boolean"},
                                    "concurrency": _CONCURRENCY,
                                    "rate": _RATE,
                                },
                            }
                        }
                    },
                },
                "responses": {
                    "200": _json(
                        {"type": "object", "additionalProperties": _QUEUE}, "that queue, by name"
                    ),
                    **_errors(400, 401, 403),
                },
            },
        },
        "/ping/": {
            "get": {
                "summary": "a poller asks for its next job",
                "parameters": [
                    {
                        "name": "worker",
                        "in": "query",
                        "required": True,
                        "schema": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": MAX_ID_LENGTH,
                        },
                    },
                    _WAIT,
                    _declared("queues", "the queues it takes jobs from (default: default)"),
                    _declared("labels", "the labels it has (default: none)"),
                ],
                "responses": {
                    "200": _json(
                        {"$ref": "#/components/schemas/Claim"},
                        "the next job, now requested by this poller, with its lease",
                    ),
                    "204": {"description": "no job came within wait"},
                    **_errors(400, 401, 403),
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "this document",
                "responses": {"200": _json({"type": "object"}, "OpenAPI 3"), **_errors(401, 403)},
            }
        },
        "/": {
            "get": {
                "summary": "the operator's console: its overview (HTML; the rest under /ui/)",
                "responses": {
                    "200": {
                        "description": "workers, queues, counters, jobs ended per second, "
                        "latest jobs",
                        "content": {"text/html": {"schema": _TEXT}},
                    },
                    "401": {
                        "description": "no console session (http_token_file is set): the "
                        "login form",
                        "content": {"text/html": {"schema": _TEXT}},
                    },
                    **_errors(403, 429),
                },
            }
        },
    },
    "components": {
        "schemas": {
            "Error": {
                "type": "object",
                "required": ["code", "message"],
                "properties": {"code": {"type": "integer"}, "message": _TEXT},
            },
            "Health": {
                "type": "object",
                "required": ["uptime", "workers", "pending"],
                "properties": {
                    "uptime": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+s$"},
                    "workers": {"type": "integer", "minimum": 0},
                    "pending": {"type": "integer", "minimum": 0},
                },
            },
            "NewJob": {
                "type": "object",
                "additionalProperties": False,
                "allOf": [
                    {"not": {"required": ["payload", "payload_b64"]}},
                    {"not": {"required": ["delay", "run_at"]}},
                ],
                "properties": {
                    "id": {"type": "string", "pattern": ID_PATTERN},
                    "name": _SHORT,
                    "info_url": _SHORT,
                    "download_url": _SHORT,
                    "payload": _TEXT,
                    "payload_b64": {"type": "string", "format": "byte"},
                    **OPTIONS_IN,
                },
            },
            "Queue": {
                "type": "object",
                "required": [
                    "pending",
                    "scheduled",
                    "working",
                    "workers",
                    "paused",
                    "concurrency",
                    "rate",
                ],
                "properties": {
                    "pending": {"type": "integer", "minimum": 0},
                    "scheduled": {"type": "integer", "minimum": 0},
                    "working": {"type": "integer", "minimum": 0},
                    "workers": {"type": "integer", "minimum": 0},
                    "paused": {"type": "boolean"},
                    "concurrency": _CONCURRENCY,
                    "rate": _RATE,
                },
            },
            "Update": {
                "type": "object",
                "additionalProperties": False,
                "anyOf": [{"required": ["state"]}, {"required": ["log"]}],
                "not": {"required": ["result", "result_b64"]},
                "allOf": PROGRESS_RULES,
                "properties": {
                    "state": {
                        "type": "string",
                        "enum": sorted(codec.USER_STATES | codec.POLLER_STATES),
                    },
                    "log": {"type": "string", "maxLength": codec.MAX_LOG},
                    "worker": {"type": "string", "maxLength": MAX_ID_LENGTH},
                    "lease": {
                        "type": "string",
                        "maxLength": codec.MAX_LEASE,
                        "description": "a poller's report (a PUT naming `worker`) must carry the "
                        "lease its claim (GET /ping/) gave; without it or with another: 409",
                    },
                    "result": _TEXT,
                    "result_b64": {"type": "string", "format": "byte"},
                    "error": {"type": "string", "maxLength": codec.MAX_ERROR},
                    **PROGRESS_IN,
                },
            },
            "Claim": {
                "allOf": [
                    _JOB,
                    {
                        "type": "object",
                        "required": ["lease"],
                        "properties": {
                            "lease": {
                                "type": "string",
                                "minLength": 22,
                                "description": "a random token (128 bits) shown in this answer "
                                "only: every later PUT of this poller on this job carries it",
                            }
                        },
                    },
                ]
            },
            "Job": {
                "type": "object",
                "required": [
                    "id",
                    "task_id",
                    "door",
                    "name",
                    "state",
                    "added_at",
                    "updated_at",
                    "attempts",
                    "worker",
                    "info_url",
                    "download_url",
                    "log",
                    "error",
                    "failed_post",
                    *OPTIONS_OUT,
                    *PROGRESS_OUT,
                ],
                "properties": {
                    "id": _TEXT,
                    "task_id": {"type": "integer", "minimum": 1},
                    "door": {"type": "string", "enum": ["udp", "http", "redis"]},
                    "name": _TEXT,
                    "state": {"type": "string", "enum": [s.value for s in JobState]},
                    "added_at": {"type": "string", "format": "date-time"},
                    "updated_at": {"type": "string", "format": "date-time"},
                    "attempts": {"type": "integer", "minimum": 0},
                    "worker": {"type": "string", "nullable": True},
                    "info_url": _TEXT,
                    "download_url": _TEXT,
                    "log": {"type": "array", "items": _TEXT},
                    "error": _TEXT,
                    "failed_post": {"type": "boolean"},
                    "payload": _TEXT,
                    "payload_b64": {"type": "string", "format": "byte"},
                    "result": _TEXT,
                    "result_b64": {"type": "string", "format": "byte"},
                    "usage": {
                        "type": "object",
                        "nullable": True,
                        "properties": {
                            "wall": {"type": "number"},
                            "cpu": {"type": "number"},
                            "max_rss": {"type": "integer"},
                            "memory_peak": {"type": "integer"},
                        },
                    },
                    "reason": {
                        "type": "string",
                        "nullable": True,
                        "enum": ["limit", "error", "timeout", "lost", "placement", None],
                    },
                    **OPTIONS_OUT,
                    **PROGRESS_OUT,
                },
            },
        }
    },
}
OPENAPI["paths"].update(BATCH_PATHS)
