"""Who may use the HTTP door: `allowed_clients` (403 on every path) and bearer tokens
(401 on every API path but /health/), checked by the router before any endpoint (not as a
middleware: a coroutine layer costs at every one of a request's ~11 resumptions).

The tokens are those of `http_token_file` now: the file is read at start (one that cannot be
read, or holds no token, stops the start), then again whenever its mtime changes (looked at
no more than once a second), through the same `TokenFile` as the console's logins. A file
that becomes unreadable or empty holds no token: every request needing one gets 401.

The console (`/` and /ui/...) checks its own session cookie instead of a bearer token
(controller/shell/console/handlers.py); that cookie also opens `GET /job/{id}/output`,
which a job's page shows in a frame."""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Callable, Sequence
from pathlib import Path

import trio

from controller.frontdoor import cached_allowed
from controller.shell.asgi import JOB_PREFIX, Response, Scope, error_response
from controller.shell.console.session import TokenFile
from controller.shell.console.web import is_console_path
from controller.shell.core_shell import StartupError


def read_tokens(path: Path) -> frozenset[str]:
    """One bearer token a line (blank lines and #-comments ignored); StartupError if unusable."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise StartupError(f"http_token_file {path}: {reason}") from None
    tokens = frozenset(
        line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")
    )
    if not tokens:
        raise StartupError(f"http_token_file {path}: no token in it (one a line)")
    return tokens


class Gate:
    """`allowed_clients` on every path (403), then bearer tokens on every path but
    /health/ (401); `refused` counts the refusals for the console's overview."""

    def __init__(
        self,
        networks: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network],
        tokens: TokenFile | None,
        session_ok: Callable[[Scope], bool] = lambda scope: False,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        """`tokens`: the token file (None: no token needed), shared with the console's logins
        and looked at on `clock` as theirs is; `session_ok(scope)`: whether a request
        carries a good console session."""
        self.clock = clock
        self.networks = tuple(networks)
        self.tokens = tokens
        self.session_ok = session_ok
        self.refused = 0
        self._allowed: dict[str, bool] = {}

    def refusal(self, scope: Scope) -> Response | None:
        """The answer to a request this gate refuses (403, 401), or None to let it through."""
        client = scope.get("client")
        host = client[0] if client else ""
        if not cached_allowed(host, self.networks, self._allowed):
            self.refused += 1
            return error_response(403, "this address is not in allowed_clients")
        path: str = scope["path"]
        needs_token = self.tokens is not None and path.rstrip("/") != "/health"
        if needs_token and is_console_path(path):
            return None  # the console asks for its session itself
        if needs_token and not self._token_ok(scope) and not self._output_read(scope):
            self.refused += 1
            refusal = error_response(401, "a valid 'Authorization: Bearer <token>' is needed")
            refusal.headers.append((b"www-authenticate", b"Bearer"))
            return refusal
        return None

    def _output_read(self, scope: Scope) -> bool:
        """A console session reading a job's output (GET /job/{id}/output)."""
        path: str = scope["path"].rstrip("/")
        if not path.endswith("/output") or scope.get("method") not in ("GET", "HEAD"):
            return False
        job_id = path[len(JOB_PREFIX) : -len("/output")]
        return path.startswith(JOB_PREFIX) and "/" not in job_id and self.session_ok(scope)

    def _token_ok(self, scope: Scope) -> bool:
        assert self.tokens is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() != "bearer":
                    return False
                # The header's own bytes, hashed as the file's UTF-8 lines are: a token sent
                # in UTF-8 matches, anything else does not (compared in constant time).
                hashed = hashlib.sha256(token.strip().encode("latin-1")).hexdigest()
                return self.tokens.holds(hashed, self.clock())
        return False
