"""Handlers the real-process worker tests load with `--handler tests.worker_handlers:NAME`.

Each payload names a file; the handler returns once that file exists (bounded), so a test
decides when the job ends without sleeping.
"""

from __future__ import annotations

import time
from pathlib import Path

import trio

WAIT = 20.0  # seconds a handler waits for its file before it fails


def wait_for_file(payload: bytes) -> bytes:
    path = Path(payload.decode())
    deadline = time.monotonic() + WAIT
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.005)
    return b"plain:" + path.read_bytes()


async def await_file(payload: bytes) -> bytes:
    path = Path(payload.decode())
    with trio.fail_after(WAIT):
        while not path.exists():
            await trio.sleep(0.005)
    return b"async:" + path.read_bytes()


def chatty(payload: bytes) -> bytes:
    """Prints to stderr and logs (a plain handler: it runs in a thread), then echoes."""
    import logging
    import sys

    print(f"printed {payload.decode()}", file=sys.stderr)
    logging.getLogger("job").warning("logged %s", payload.decode())
    return payload


async def achatty(payload: bytes) -> bytes:
    """chatty as an async handler (it runs in the worker's trio loop)."""
    import logging
    import sys

    print(f"printed {payload.decode()}", file=sys.stderr)
    logging.getLogger("job").warning("logged %s", payload.decode())
    return payload
