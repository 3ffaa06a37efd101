"""Clients of the controller.

`Client` (sync_client.py), `AsyncClient` (async_client.py): the Python library, over
http://, https://, udp:// and redis://. Its exceptions (errors.py) share one base,
`ClientError`: `JobFailed` and `ControllerError` under it.
`UdpSession` (udp_engine.py): the UDP engine of the `udp-client` command (udp_cli.py,
udp_output.py), and of the library's udp:// backend (udp_backend.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from controller.client.errors import ClientError, ControllerError, JobFailed
from controller.client.udp_engine import Outcome, UdpSession

if TYPE_CHECKING:
    from controller.client.async_client import AsyncClient, AsyncJob
    from controller.client.job_calls import Batch
    from controller.client.sync_client import Client, Job

__all__ = [
    "AsyncClient",
    "AsyncJob",
    "Batch",
    "Client",
    "ClientError",
    "ControllerError",
    "Job",
    "JobFailed",
    "Outcome",
    "UdpSession",
]


def __getattr__(name: str) -> Any:
    # The library (and redis-py) is loaded on first use, so that udp-client starts quickly.
    if name in {"Client", "Job"}:
        from controller.client import sync_client

        return getattr(sync_client, name)
    if name == "Batch":
        from controller.client import job_calls

        return job_calls.Batch
    if name in {"AsyncClient", "AsyncJob"}:
        from controller.client import async_client

        return getattr(async_client, name)
    raise AttributeError(f"module 'controller.client' has no attribute {name!r}")
