"""A job's output on the worker side: what it writes to stderr, gathered for the controller.

How this works. Each worker holds one `OutputSink` and makes it the current
one (`SINK`, a context variable) wherever a job runs: the trio task that runs
an async handler, the thread that runs a plain one, and an `--exec`
command's stderr pipe, whose reader writes into it directly. A `--handler`
writes to `sys.stderr`, or logs through the logging module (whose stream
handler writes to `sys.stderr`): `capture_stderr()` puts a `_Stderr` in front
of the real stream once, at start, and that object sends a write to the
current context's sink when there is one, and to the real stream otherwise
(the worker's own log lines). Nothing here runs for a job that writes
nothing.

The sink holds at most `BUFFER_LIMIT` bytes waiting to be sent: past it the
oldest go, and what is sent next starts with a line saying how many bytes
were dropped. Its owner takes the bytes out in pieces of at most
`CHUNK` (`take`), at most every `BATCH_SECONDS` unless `CHUNK` bytes are
waiting; `on_data` tells the owner that bytes arrived when there
were none (or a whole chunk is waiting), from whatever thread wrote them.
"""

from __future__ import annotations

import contextvars
import io
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO

# How often output leaves a worker at most while less than a chunk waits: a person following
# a job sees a line within this, and a chatty job costs a few exchanges a second.
BATCH_SECONDS = 0.2
# Bytes of output one PULSE_OUTPUT (or one lease PUT) carries at most; a full chunk leaves at
# once. Well under the controller's cap on a pulse's extra bytes (controller/output.py).
CHUNK = 16 * 1024
# Bytes a worker holds for the controller at most (a job writing faster than they can be
# sent, or a controller that is away): the oldest go first.
BUFFER_LIMIT = 256 * 1024


class OutputSink:
    """Bytes a job wrote, waiting to be sent; written from any thread."""

    __slots__ = ("_buf", "_lock", "dropped", "limit", "on_data")

    def __init__(
        self, on_data: Callable[[], None] | None = None, limit: int = BUFFER_LIMIT
    ) -> None:
        self._buf = bytearray()
        self._lock = threading.Lock()
        self.dropped = 0  # bytes dropped since the last `take`
        self.limit = limit
        self.on_data = on_data

    def __len__(self) -> int:
        return len(self._buf)

    def write(self, data: bytes) -> None:
        """Keep `data` for the controller (the oldest waiting bytes go past `limit`)."""
        if not data:
            return
        with self._lock:
            buf = self._buf
            was = len(buf)
            buf += data
            over = len(buf) - self.limit
            if over > 0:
                del buf[:over]
                self.dropped += over
            wake = was == 0 or (was < CHUNK <= len(buf))
        if wake and self.on_data is not None:
            self.on_data()

    def take(self, most: int = CHUNK) -> bytes:
        """Up to `most` waiting bytes, oldest first (after a note of what was dropped)."""
        with self._lock:
            note = b""
            if self.dropped:
                note = f"[worker: {self.dropped} bytes of output dropped]\n".encode()
                self.dropped = 0
            room = max(0, most - len(note))
            data = bytes(self._buf[:room])
            del self._buf[:room]
        return note + data

    def clear(self) -> None:
        """Forget what waits (a job abandoned)."""
        with self._lock:
            self._buf.clear()
            self.dropped = 0


# The sink of the job running in this context (thread or trio task); None outside jobs.
SINK: contextvars.ContextVar[OutputSink | None] = contextvars.ContextVar("SINK", default=None)


def write(data: bytes) -> None:
    """Add `data` to the current job's output (dropped outside a job)."""
    sink = SINK.get()
    if sink is not None:
        sink.write(data)


class _Stderr(io.TextIOBase):
    """sys.stderr while jobs may run: a job's writes go to its sink, the rest to `real`."""

    def __init__(self, real: TextIO) -> None:
        super().__init__()
        self.real = real

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.real.encoding

    def __getattr__(self, name: str) -> Any:  # encoding, errors, buffer...: the real stream's
        return getattr(self.real, name)

    def write(self, text: str) -> int:
        sink = SINK.get()
        if sink is None:
            return self.real.write(text)
        sink.write(text.encode("utf-8", "backslashreplace"))
        return len(text)

    def flush(self) -> None:
        if SINK.get() is None:
            self.real.flush()

    def fileno(self) -> int:
        return self.real.fileno()

    def isatty(self) -> bool:
        return SINK.get() is None and self.real.isatty()

    def writable(self) -> bool:
        return True


def capture_stderr() -> None:
    """Route a job's writes to sys.stderr (and so its logging) to its sink. Call it once,
    before logging is set up, so that the logging stream handler writes through it."""
    if not isinstance(sys.stderr, _Stderr):
        sys.stderr = _Stderr(sys.stderr)
