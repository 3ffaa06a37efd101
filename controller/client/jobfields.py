"""The job options a client sends, checked the way the controller checks them.

`submit(..., queue=..., delay=...)` and `udp-client add --queue ...` build the same fields:
the options the caller gave (None: not sent), as JSON values, `run_at` as RFC 3339 text.
They are read with the controller's own reader (controller/options.py) before anything is
sent, so a bad value is a `ValueError` carrying the message the controller would answer,
and a request that leaves the client is one the controller takes. The Redis door reads
entry fields as text: `as_text` writes them so.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from controller.options import DEFAULT, OPTIONS, BadOption, parse, rfc3339

# The options `submit` takes: every one the controller reads.
SUBMIT_OPTIONS = OPTIONS


def option_fields(**given: Any) -> dict[str, Any]:
    """The options given (None: left out) as JSON values, checked. Raises ValueError."""
    unknown = set(given) - set(SUBMIT_OPTIONS)
    if unknown:
        raise TypeError(f"unknown job option(s): {', '.join(sorted(unknown))}")
    fields: dict[str, Any] = {}
    for name in SUBMIT_OPTIONS:
        value = given.get(name)
        if value is None:
            continue
        if name == "run_at":
            value = _run_at(value)
        elif name in ("requires", "after") and isinstance(value, tuple | list):
            value = list(value)
        fields[name] = value
    try:
        parse(fields, DEFAULT, time.time())
    except BadOption as exc:
        raise ValueError(str(exc)) from None
    return fields


def _run_at(value: Any) -> str:
    if not isinstance(value, datetime):
        raise ValueError(f"run_at must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError("run_at must be an aware datetime (with a tzinfo), got a naive one")
    return rfc3339(value.timestamp())


def initial_state(fields: Mapping[str, Any]) -> str:
    """The state a job with these (checked) fields starts in: `scheduled` when it waits for
    a time still to come, `waiting` when it waits for other jobs, else `pending`."""
    options = parse(fields, DEFAULT, time.time())
    if options.after:
        return "waiting"
    return "pending" if options.run_at is None else "scheduled"


def as_text(fields: Mapping[str, Any]) -> dict[str, str]:
    """Checked fields as a Redis entry carries them: text, `requires` comma separated."""
    out: dict[str, str] = {}
    for name, value in fields.items():
        if isinstance(value, list):
            out[name] = ",".join(value)
        elif isinstance(value, bool):
            out[name] = "true" if value else "false"
        elif isinstance(value, dict):  # limits: a JSON object
            out[name] = json.dumps(value)
        elif isinstance(value, float):
            out[name] = repr(value)  # round-trips exactly through float()
        else:
            out[name] = str(value)
    return out


def _number(value: float) -> float | int:
    """A JSON number as a person would write it: 30, not 30.0."""
    return int(value) if math.isfinite(value) and value.is_integer() else value


def _from_text(name: str) -> Callable[[str], Any]:
    def read(text: str) -> Any:
        try:
            options = parse({name: text}, DEFAULT, time.time(), text=True)
        except BadOption as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if name == "requires":
            return [part.strip() for part in text.split(",") if part.strip()]
        if name == "delay":
            return _number(float(text))
        value = getattr(options, name)
        return _number(value) if isinstance(value, float) else value

    read.__name__ = name  # argparse names the type in some of its messages
    return read


# udp-client add's option flags: (flag, option name, metavar, help).
CLI_OPTIONS = (
    ("--queue", "queue", "NAME", "the queue to put the job in (default: default)"),
    ("--priority", "priority", "N", "-100..100; higher runs first (default 0)"),
    ("--requires", "requires", "LABEL,...", "labels the worker must all have"),
    ("--delay", "delay", "SECONDS", "wait this long before the job may start"),
    ("--max-retries", "max_retries", "N", "0..100 retries for this job (default: the config's)"),
    (
        "--retry-delay",
        "retry_delay",
        "SECONDS",
        "wait before the first retry, doubled at each further one",
    ),
    ("--timeout", "timeout", "SECONDS", "how long a worker may hold the job (0: no limit)"),
    (
        "--placement-timeout",
        "placement_timeout",
        "SECONDS",
        "how long the job may wait to start, then it fails",
    ),
)


def add_cli_options(parser: argparse.ArgumentParser) -> None:
    """The job option flags of `udp-client add`; each value is read as the controller reads
    it (a bad one is a usage error, exit 2), into `args.option_<name>`."""
    group = parser.add_argument_group("job options (sent with every job)")
    for flag, name, metavar, help_text in CLI_OPTIONS:
        group.add_argument(
            flag, dest=f"option_{name}", metavar=metavar, type=_from_text(name), help=help_text
        )


def cli_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The job options given on the command line, as `params.<name>` JSON values."""
    fields = {}
    for _flag, name, _metavar, _help in CLI_OPTIONS:
        value = getattr(args, f"option_{name}", None)
        if value is not None:
            fields[name] = value
    return fields
