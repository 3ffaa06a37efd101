"""The client library's one error tree.

    ClientError            the library or the controller refused (catch this one)
    +-- JobFailed          a job ended without a result: failed, canceled or deleted
    +-- ControllerError    the controller refused a request (an HTTP status, a UDP
                           error code, or "redis" for a Redis failure)

Failures of the network stay builtin: `ConnectionError` (refused, reset, a TLS
certificate not trusted), `TimeoutError`; so do `KeyError` (no such job) and
`ValueError` (a bad argument).
"""

from __future__ import annotations

__all__ = ["ClientError", "ControllerError", "JobFailed"]


class ClientError(Exception):
    """The base of every exception the client library defines."""


class JobFailed(ClientError):
    """The job ended without a result: failed, canceled or deleted; `error` says why."""

    def __init__(self, job_id: str, state: str, error: str) -> None:
        super().__init__(f"job {job_id} {state}: {error}")
        self.job_id = job_id
        self.state = state
        self.error = error or state


class ControllerError(ClientError):
    """The controller refused a request: `status` (HTTP status, or the UDP error code)."""

    def __init__(self, status: int | str, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
