"""A job's progress in the OpenAPI document (controller/doors/http/openapi.py): the job
object's `progress` and `status`, and a poller's report of them in its `PUT`."""

from __future__ import annotations

from typing import Any

from controller.progress import MAX_STATUS

_FRACTION = {"type": "number", "minimum": 0, "maximum": 1}

# The job object's fields: what its worker last reported (null: nothing yet).
PROGRESS_OUT: dict[str, Any] = {
    "progress": {
        **_FRACTION,
        "nullable": True,
        "description": "how far the running job is, as its worker last reported (0 to 1); "
        "an ended job keeps its last value; null until it reports",
    },
    "status": {
        "type": "string",
        "nullable": True,
        "maxLength": MAX_STATUS,
        "description": "what the job does now, as its worker last reported",
    },
}

# A poller's PUT: `status` only with `progress`, both only from the poller holding the job.
PROGRESS_IN: dict[str, Any] = {
    "progress": {
        **_FRACTION,
        "description": "the poller holding the job (`worker`, `lease`) reports how far it is",
    },
    "status": {"type": "string", "maxLength": MAX_STATUS, "description": "with `progress`"},
}

# The PUT's rules: `status` only with `progress`, `progress` only with `worker`.
PROGRESS_RULES: list[dict[str, Any]] = [
    {"anyOf": [{"not": {"required": ["status"]}}, {"required": ["progress"]}]},
    {"anyOf": [{"not": {"required": ["progress"]}}, {"required": ["worker"]}]},
]
