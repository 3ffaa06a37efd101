"""The console's cookies: who is logged in, and the CSRF token every form carries.

Two cookies, both HttpOnly, SameSite=Strict, Path=/ (and Secure over TLS), both signed with
a key made at start (so every session ends with the process):

- `console_browser`: a random id for this browser, set on the first console page it gets.
  Every form's CSRF token is an HMAC of that id; a POST whose `csrf` field does not match is
  refused (403). Logging out gives the browser a new id, so the old tokens die with it.
- `console_session` (only with `http_token_file`): the browser's id and a SHA-256 of the
  token it logged in with (never the token), time-stamped. It is good for SESSION_SECONDS
  and only while that token is still in the token file, re-read when its mtime changes
  (looked at no more than once a second).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence
from pathlib import Path

from itsdangerous import BadSignature, Signer, URLSafeTimedSerializer

from controller.tokens import read_file, token_lines

BROWSER_COOKIE = "console_browser"
SESSION_COOKIE = "console_session"
# How long a login lasts.
SESSION_SECONDS = 12 * 3600
# How often, at most, the token file's mtime is looked at.
RECHECK_SECONDS = 1.0
# A cookie header longer than this is not parsed (ours are ~150 bytes).
MAX_COOKIE_HEADER = 8192


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def parse_cookies(header: str | None) -> dict[str, str]:
    """name=value pairs of a Cookie header (the first of a repeated name)."""
    found: dict[str, str] = {}
    if not header or len(header) > MAX_COOKIE_HEADER:
        return found
    for part in header.split(";"):
        name, sep, value = part.strip().partition("=")
        if sep and name not in found:
            found[name] = value.strip().strip('"')
    return found


class TokenFile:
    """The token file's tokens as hashes, re-read when its mtime changes; an unreadable or
    missing file holds no token (so every session ends)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mtime: int | None = None
        self._checked = -RECHECK_SECONDS
        self._hashes: tuple[str, ...] = ()

    def hashes(self, now: float) -> tuple[str, ...]:
        if now - self._checked >= RECHECK_SECONDS:
            self._checked = now
            try:
                mtime: int | None = self.path.stat().st_mtime_ns
            except OSError:
                mtime = None
            if mtime != self._mtime:
                self._mtime = mtime
                self._hashes = self._read() if mtime is not None else ()
        return self._hashes

    def _read(self) -> tuple[str, ...]:
        try:
            text = read_file(self.path)
        except ValueError:
            return ()
        return tuple(token_hash(token) for _, token in token_lines(text))

    def holds(self, hashed: str, now: float) -> bool:
        return any(hmac.compare_digest(hashed, known) for known in self.hashes(now))


class Sessions:
    """Signs and checks the console's cookies; `tokens` is None without a token file (then
    the console needs no login, and the browser cookie serves the CSRF tokens alone)."""

    def __init__(self, tokens: TokenFile | None, secure: bool) -> None:
        self.tokens = tokens
        self.secure = secure
        self._key = secrets.token_bytes(32)
        self._browser = Signer(self._key, salt="console-browser")
        self._session = URLSafeTimedSerializer(self._key, salt="console-session")

    @property
    def login_needed(self) -> bool:
        return self.tokens is not None

    # ------------------------------------------------------------ the browser and CSRF

    def new_browser(self) -> str:
        return secrets.token_urlsafe(18)

    def browser_of(self, cookies: dict[str, str]) -> str | None:
        """The browser id its signed cookie holds, or None."""
        signed = cookies.get(BROWSER_COOKIE)
        if not signed:
            return None
        try:
            return self._browser.unsign(signed.encode("ascii")).decode("ascii")
        except (BadSignature, UnicodeError):
            return None

    def csrf(self, browser: str) -> str:
        digest = hmac.new(self._key, b"csrf:" + browser.encode("ascii"), hashlib.sha256)
        return digest.hexdigest()

    def csrf_ok(self, browser: str | None, given: str | None) -> bool:
        if browser is None or not given:
            return False
        return hmac.compare_digest(self.csrf(browser).encode(), given.encode("utf-8", "replace"))

    # ------------------------------------------------------------ login sessions

    def check_token(self, token: str, now: float) -> str | None:
        """The hash of `token` if it is in the token file now, else None."""
        if self.tokens is None or not token or len(token) > 4096:
            return None
        hashed = token_hash(token)
        return hashed if self.tokens.holds(hashed, now) else None

    def valid(self, cookies: dict[str, str], browser: str | None, now: float) -> bool:
        """Whether the request's session is good: signed by us, younger than 12 h, of this
        browser, and its token still in the file. Always True without a token file."""
        if self.tokens is None:
            return True
        signed = cookies.get(SESSION_COOKIE)
        if not signed or browser is None:
            return False
        try:
            data = self._session.loads(signed, max_age=SESSION_SECONDS)
        except BadSignature:  # a bad signature, or expired (SignatureExpired is one)
            return False
        if not isinstance(data, dict):
            return False
        of, hashed = data.get("b"), data.get("t")
        if not isinstance(of, str) or not isinstance(hashed, str):
            return False
        return hmac.compare_digest(of, browser) and self.tokens.holds(hashed, now)

    # ------------------------------------------------------------ Set-Cookie headers

    def _cookie(self, name: str, value: str, max_age: int | None) -> tuple[bytes, bytes]:
        parts = [f"{name}={value}", "Path=/", "HttpOnly", "SameSite=Strict"]
        if max_age is not None:
            parts.append(f"Max-Age={max_age}")
        if self.secure:
            parts.append("Secure")
        return b"set-cookie", "; ".join(parts).encode("ascii")

    def browser_cookie(self, browser: str) -> tuple[bytes, bytes]:
        signed = self._browser.sign(browser.encode("ascii")).decode("ascii")
        return self._cookie(BROWSER_COOKIE, signed, None)

    def session_cookies(self, browser: str, hashed: str) -> Sequence[tuple[bytes, bytes]]:
        value = self._session.dumps({"b": browser, "t": hashed})
        assert isinstance(value, str)
        return [self._cookie(SESSION_COOKIE, value, SESSION_SECONDS)]

    def logout_cookies(self) -> Sequence[tuple[bytes, bytes]]:
        """The session cleared, and a new browser id (the old CSRF tokens are void)."""
        return [self._cookie(SESSION_COOKIE, "", 0), self.browser_cookie(self.new_browser())]
