"""`jobctl watch`: the controller's event stream (`GET /events/`), one line per event.

The stream is Server-Sent Events; `EventReader` reads it (sans-IO: bytes in, events out).
`watch` prints each job change as a line (time, job id, state, queue, progress), or with
--json the event's data, until interrupted; when the connection drops (or the controller
stops and starts again) it connects again after a pause, with the last event's id as
`last_event_id`, so that nothing in the controller's ring of the last events is missed.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from controller.client.http import HttpPool
from controller.client.httpwire import Answer

# Waits between attempts to connect again (seconds): doubled up to the last.
PAUSES = (0.5, 1.0, 2.0, 5.0)
MAX_LINE = 1024 * 1024  # a longer line is not an event of this controller: the stream is cut


class EventReader:
    """Server-Sent Events from bytes: `feed` gives the complete events as (name, id, data)
    (name "message" when the event has none; id "" when it has none)."""

    def __init__(self) -> None:
        self._rest = b""
        self._name = ""
        self._id = ""
        self._data: list[str] = []

    def feed(self, data: bytes) -> list[tuple[str, str, str]]:
        events = []
        lines = (self._rest + data).split(b"\n")
        self._rest = lines.pop()
        if len(self._rest) > MAX_LINE:
            raise ConnectionError("the event stream has a line over 1 MB")
        for raw in lines:
            line = raw.decode("utf-8", "replace").removesuffix("\r")
            if not line:
                if self._data or self._name:
                    events.append((self._name or "message", self._id, "\n".join(self._data)))
                self._name, self._id, self._data = "", "", []
                continue
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "data":
                self._data.append(value)
            elif field == "id":
                self._id = value
            elif field == "event":
                self._name = value
        return events


def event_line(data: dict[str, Any], at: float) -> str:
    """One event as `watch` prints it: local time, job id, state, queue, progress."""
    progress = data.get("progress")
    shown = f"{progress * 100:.0f}%" if isinstance(progress, int | float) else "-"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
    return f"{stamp}  {data.get('id')}  {data.get('state')}  {data.get('queue')}  {shown}"


def watch(
    pool: HttpPool,
    queue: str | None,
    as_json: bool,
    refused: Callable[[int, bytes], Exception],
    out: TextIO = sys.stdout,
    warn: Callable[[str], None] = lambda text: print(text, file=sys.stderr),
) -> None:
    """Print the events until interrupted (KeyboardInterrupt goes to the caller); an answer
    other than 200 raises `refused(status, body)`."""
    last = ""
    failures = 0
    while True:
        query: dict[str, Any] = {}
        if queue is not None:
            query["queue"] = queue
        if last:
            query["last_event_id"] = last
        try:
            with pool.stream("GET", "/events/", query=query) as answer:
                if answer.status != 200:
                    raise refused(answer.status, answer.read())
                failures = 0
                reader = EventReader()
                for piece in answer:
                    for name, event_id, data in reader.feed(piece):
                        if event_id:
                            last = event_id
                        if name == "reset":
                            warn(
                                "jobctl watch: some events were missed (the controller "
                                "restarted, or the connection was down too long)"
                            )
                        elif name == "message":
                            _print(data, as_json, out)
            why = "the controller ended the stream"
        except OSError as exc:  # ConnectionError, TimeoutError: down, or cut short
            why = str(exc)
        pause = PAUSES[min(failures, len(PAUSES) - 1)]
        failures += 1
        if failures == 1 or failures % 10 == 0:
            warn(f"jobctl watch: {why}; connecting again")
        time.sleep(pause)


def _print(data: str, as_json: bool, out: TextIO) -> None:
    try:
        event = json.loads(data)
    except ValueError:
        return
    if not isinstance(event, dict):
        return
    if as_json:
        out.write(json.dumps(event) + "\n")
    else:
        out.write(event_line(event, time.time()) + "\n")
    out.flush()


def add_watch_command(command: Callable[[str, str, str], Any]) -> None:
    """`jobctl watch`'s arguments (`command` makes a subcommand's parser)."""
    parser = command(
        "watch",
        "print every job change as it happens",
        "Print one line per job change (time, job id, state, queue, progress) as the "
        "controller's event stream tells them, until interrupted (Ctrl-C exits 0); when the "
        "connection drops it connects again and resumes after the last event it printed.",
    )
    parser.add_argument("--queue", metavar="QUEUE", help="only the jobs of QUEUE")


def run_watch(
    api: Any,
    args: Any,
    refusal: Callable[[int, str, str], Exception],
    message: Callable[[Answer], str],
) -> int:
    """The command (`api`: jobctl's Api): a refusal is said as jobctl says any other
    (`refusal(status, message, what)`, `message(answer)`: jobctl's own)."""

    def refused(status: int, body: bytes) -> Exception:
        return refusal(status, message(Answer(status, body)), "watch")

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: the way to stop watching
        watch(api.pool, args.queue, args.json, refused)
    return 0
