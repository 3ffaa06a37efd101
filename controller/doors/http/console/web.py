"""The console's plumbing: its answers' headers, its static files, forms, and what a
request shows of its browser."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qsl, quote

from controller.doors.http.asgi import BodyTimeout, ClientDisconnect, Request, Response
from controller.doors.http.codec import ApiError
from controller.doors.http.console.session import Sessions, parse_cookies
from controller.doors.http.keepalive import request_deadline

# A form's body (a filter, a token, a button) is small; one longer than this is refused.
MAX_FORM = 16 * 1024
# Seconds a form (its head and body) may take to arrive.
FORM_SECONDS = 10.0
HTML = "text/html; charset=utf-8"
# The longest page address a login goes back to.
MAX_THEN = 2048
STATIC_TYPES = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8"}
# Only our own files: no inline script or style, no framing by other sites.
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; img-src 'self' data:; frame-ancestors 'self'; "
        b"form-action 'self'; base-uri 'none'; object-src 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
]

Handler = Callable[[Request], Awaitable[Response]]


def is_console_path(path: str) -> bool:
    return path == "/" or path == "/ui" or path.startswith("/ui/")


def static_files() -> dict[str, bytes]:
    folder = resources.files("controller.doors.http.console") / "static"
    return {
        item.name: item.read_bytes()
        for item in folder.iterdir()
        if Path(item.name).suffix in STATIC_TYPES
    }


def then_target(target: str) -> str:
    """Where a login goes next: a console page of this controller (never another site)."""
    path, _, query = target.partition("?")
    if not is_console_path(path) or path.startswith("/ui/login") or len(target) > MAX_THEN:
        return "/"
    path = quote(path, safe="/%")
    return path + "?" + quote(query, safe="=&%+/:,;") if query else path


class Seen:
    """What one request showed of its browser: its cookies, its id (made new if it had
    none: then `headers` sets it), and whether its session is good."""

    __slots__ = ("browser", "cookies", "headers", "valid")

    def __init__(self, sessions: Sessions, request: Request, now: float) -> None:
        self.cookies = parse_cookies(request.header(b"cookie"))
        browser = sessions.browser_of(self.cookies)
        self.headers: list[tuple[bytes, bytes]] = []
        if browser is None:
            browser = sessions.new_browser()
            self.headers.append(sessions.browser_cookie(browser))
        self.browser = browser
        self.valid = sessions.valid(self.cookies, browser, now)


def by_method(get: Handler, post: Handler) -> Handler:
    """One path, two endpoints: GET (and HEAD) to `get`, POST to `post`."""

    async def endpoint(request: Request) -> Response:
        return await (post if request.method == "POST" else get)(request)

    return endpoint


async def read_form(request: Request) -> dict[str, str]:
    """An application/x-www-form-urlencoded body (at most MAX_FORM bytes)."""
    chunks = []
    size = 0
    deadline = request_deadline(request.scope, FORM_SECONDS)  # from the request's first byte
    try:
        async for chunk in request.stream(FORM_SECONDS, deadline):
            size += len(chunk)
            if size > MAX_FORM:
                raise ApiError(413, f"a form's body is at most {MAX_FORM} bytes")
            chunks.append(chunk)
    except (ClientDisconnect, BodyTimeout):  # the client left, or was too slow
        raise ApiError(400, "the form's body did not arrive") from None
    text = b"".join(chunks).decode("utf-8", "replace")
    return dict(parse_qsl(text, keep_blank_values=True))
