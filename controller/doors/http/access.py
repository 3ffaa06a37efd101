"""Who may use the HTTP door: `allowed_clients` (403 on every path), bearer tokens (401 on
every API path but /health/), and addresses that guessed tokens (429), checked by the router
before any endpoint (not as a middleware: a coroutine layer costs at every one of a request's
~11 resumptions).

The tokens are those of `http_token_file` now: the file is read at start (one that cannot be
read, or holds no token, stops the start), then again whenever its mtime changes (looked at
no more than once a second), through the same `TokenFile` as the console's logins. A file
that becomes unreadable or empty holds no token: every request needing one gets 401.

The console (`/` and /ui/...) checks its own session cookie; a valid bearer token opens its
pages too (the gate marks such a request with `BEARER` in its scope), while its forms still
need the session. The session cookie also opens `GET /job/{id}/output`, which a job's page
shows in a frame.

Guessing is slowed down (`Strikes`): after `STRIKES` requests from one address within
`STRIKE_WINDOW` seconds that carried a wrong bearer token or a wrong console login token
(requests carrying none do not count), that address gets 429 on every path but
GET /health/ for `BLOCK_SECONDS`. What is remembered per address is bounded, and so is the
number of addresses (`MAX_ADDRESSES`, the least recently seen forgotten first); a request
from an address never refused costs one dict lookup, and none while no address is blocked."""

from __future__ import annotations

import hashlib
import ipaddress
import math
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import trio

from controller.allowlist import cached_allowed
from controller.doors.http.asgi import JOB_PREFIX, Response, Scope, error_response
from controller.doors.http.console.session import TokenFile
from controller.doors.http.console.web import is_console_path
from controller.errors import StartupError
from controller.tokens import read_file, token_lines

# Refused tokens from one address within STRIKE_WINDOW seconds that make it wait (429) ...
STRIKES = 10
STRIKE_WINDOW = 60.0
# ... for this long.
BLOCK_SECONDS = 60.0
# Addresses remembered for their strikes, and blocked ones (each at most): past it the least
# recently struck (the earliest blocked) are forgotten, so a spread of addresses costs bounded
# memory.
MAX_ADDRESSES = 65536
# The scope key that says a request carried a valid bearer token (for the console's pages).
BEARER = "controller.bearer"


def read_tokens(path: Path) -> frozenset[str]:
    """Every token of the file (controller/tokens.py); StartupError if unusable."""
    try:
        tokens = frozenset(token for _, token in token_lines(read_file(path)))
    except ValueError as exc:
        raise StartupError(f"http_token_file {exc}") from None
    if not tokens:
        raise StartupError(f"http_token_file {path}: no token in it (one a line)")
    return tokens


class Strikes:
    """Refused tokens by address, and the addresses that wait for it (see the module's
    docstring). Time is an argument."""

    def __init__(self) -> None:
        # Each address's latest strike times, least recently struck first.
        self._recent: dict[str, deque[float]] = {}
        # Blocked addresses and until when, earliest first (one BLOCK_SECONDS for all).
        self.blocked: dict[str, float] = {}

    def strike(self, host: str, now: float) -> None:
        """A request from `host` carried a wrong token."""
        recent = self._recent
        times = recent.pop(host, None)
        if times is None:
            times = deque(maxlen=STRIKES)
        times.append(now)
        if len(times) == STRIKES and now - times[0] < STRIKE_WINDOW:
            self.blocked.pop(host, None)
            self.blocked[host] = now + BLOCK_SECONDS
            while len(self.blocked) > MAX_ADDRESSES:
                del self.blocked[next(iter(self.blocked))]
        else:
            recent[host] = times  # the most recently struck, last
        while recent:
            first = next(iter(recent))
            if len(recent) <= MAX_ADDRESSES and now - recent[first][-1] < STRIKE_WINDOW:
                break
            del recent[first]

    def until(self, host: str, now: float) -> float:
        """When `host` may ask again (0.0: now)."""
        until = self.blocked.get(host, 0.0)
        if until and now >= until:
            del self.blocked[host]
            return 0.0
        return until


class Gate:
    """`allowed_clients` on every path (403), then, with a token file, addresses that
    guessed tokens (429, on every path but GET /health/), then bearer tokens on every path
    but /health/ (401); `refused` counts the refusals for the console's overview."""

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
        self.strikes = Strikes()
        self._allowed: dict[str, bool] = {}

    def refusal(self, scope: Scope) -> Response | None:
        """The answer to a request this gate refuses (403, 429, 401), or None to let it
        through."""
        client = scope.get("client")
        host = client[0] if client else ""
        if not cached_allowed(host, self.networks, self._allowed):
            self.refused += 1
            return error_response(403, "this address is not in allowed_clients")
        if self.tokens is None:
            return None
        path: str = scope["path"]
        health = path.rstrip("/") == "/health"
        if self.strikes.blocked and not (health and scope.get("method") in ("GET", "HEAD")):
            until = self.strikes.until(host, self.clock())
            if until:
                self.refused += 1
                wait = max(1, math.ceil(until - self.clock()))
                refusal = error_response(
                    429,
                    f"too many wrong tokens from this address: try again in {wait} s",
                )
                refusal.headers.append((b"retry-after", b"%d" % wait))
                return refusal
        if health:
            return None
        given = self._token(scope)
        if given is False:
            self.strike(host)
        if is_console_path(path):
            if given:
                scope[BEARER] = True
            return None  # the console asks for its session itself
        if not given and not self._output_read(scope):
            self.refused += 1
            refusal = error_response(401, "a valid 'Authorization: Bearer <token>' is needed")
            refusal.headers.append((b"www-authenticate", b"Bearer"))
            return refusal
        return None

    def strike(self, host: str) -> None:
        """A request from `host` carried a wrong token (here, or at the console's login).
        While the file holds no token there is nothing to guess: no strike."""
        now = self.clock()
        if self.tokens is not None and self.tokens.hashes(now):
            self.strikes.strike(host, now)

    def _output_read(self, scope: Scope) -> bool:
        """A console session reading a job's output (GET /job/{id}/output)."""
        path: str = scope["path"].rstrip("/")
        if not path.endswith("/output") or scope.get("method") not in ("GET", "HEAD"):
            return False
        job_id = path[len(JOB_PREFIX) : -len("/output")]
        return path.startswith(JOB_PREFIX) and "/" not in job_id and self.session_ok(scope)

    def _token(self, scope: Scope) -> bool | None:
        """True: a valid bearer token; False: a wrong one; None: no bearer token given."""
        assert self.tokens is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                token = token.strip()
                if scheme.lower() != "bearer" or not token:
                    return None
                # The header's own bytes, hashed as the file's UTF-8 lines are: a token sent
                # in UTF-8 matches, anything else does not (compared in constant time).
                hashed = hashlib.sha256(token.encode("latin-1")).hexdigest()
                return self.tokens.holds(hashed, self.clock())
        return None
