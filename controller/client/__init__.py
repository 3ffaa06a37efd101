"""Clients of the controller.

`Client`, `AsyncClient`, `JobFailed` (api.py): the Python library, over http:// and udp://.
`UdpSession` (engine.py): the UDP engine of the `udp-client` command (cli.py, output.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from controller.client.engine import Outcome, UdpSession

if TYPE_CHECKING:
    from controller.client.api import AsyncClient, AsyncJob, Client, ControllerError, Job, JobFailed

__all__ = [
    "AsyncClient",
    "AsyncJob",
    "Client",
    "ControllerError",
    "Job",
    "JobFailed",
    "Outcome",
    "UdpSession",
]


def __getattr__(name: str) -> Any:
    # The library (and redis-py) is loaded on first use, so that udp-client starts quickly.
    if name in {"AsyncClient", "AsyncJob", "Client", "ControllerError", "Job", "JobFailed"}:
        from controller.client import api

        return getattr(api, name)
    raise AttributeError(f"module 'controller.client' has no attribute {name!r}")
