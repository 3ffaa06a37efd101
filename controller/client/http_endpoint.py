"""Where the client's HTTP requests go, and what a failed connection says.

`endpoint(url)` reads an `http://HOST:PORT[/PREFIX/]` or `https://...` URL into an
`Endpoint`: the server, the path prefix put before every request's path, the TLS context
(the certificate verified against the system's trust store, or only against `ca_file`)
and the proxy. `HTTPS_PROXY` / `HTTP_PROXY` (and `NO_PROXY`) from the environment send
the connection through that proxy with CONNECT, for https and http alike, so the proxy
sees no request and no token. A URL that cannot be used is a ValueError.

`connection_error` turns a failure of the network or of TLS into the `ConnectionError`
the client raises, naming the server (and, for a certificate not trusted, what to give
to trust it).
"""

from __future__ import annotations

import base64
import ssl
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import SplitResult, unquote, urlsplit

from controller.client.httpwire import Stale

__all__ = ["URL_FORM", "Endpoint", "Proxy", "connection_error", "endpoint", "url_port"]


def url_port(parts: SplitResult, default: int | None = None) -> int | None:
    """A split URL's port, `default` when it names none, None when it is out of range or not
    a number."""
    try:
        port = parts.port
    except ValueError:
        return None
    return default if port is None else port


URL_FORM = "http[s]://HOST:PORT[/PREFIX/]"


@dataclass(frozen=True)
class Proxy:
    """An HTTP proxy that opens tunnels with CONNECT."""

    host: str
    port: int
    authorization: str  # a Proxy-Authorization value (from the proxy URL's user:password), or ""

    def __str__(self) -> str:
        return f"{_netloc(self.host)}:{self.port}"


@dataclass(frozen=True)
class Endpoint:
    """Where requests go: the server, the path prefix, TLS and the proxy."""

    scheme: str  # http or https
    host: str
    port: int
    prefix: str  # "" or "/PREFIX", put before every request's path
    tls: ssl.SSLContext | None
    proxy: Proxy | None

    @property
    def authority(self) -> str:
        return f"{_netloc(self.host)}:{self.port}"

    def __str__(self) -> str:
        return f"{self.scheme}://{self.authority}{self.prefix}"


def _netloc(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def endpoint(url: str, *, ca_file: str | None = None) -> Endpoint:
    """The Endpoint of an `http[s]://HOST:PORT[/PREFIX/]` URL, with the proxy the
    environment names for it; ValueError when it cannot be used."""
    parts = urlsplit(url)
    port = url_port(parts)
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or not port
        or parts.query
        or parts.fragment
        or parts.username is not None
    ):
        raise ValueError(f"expected an {URL_FORM} URL, got {url!r}")
    prefix = parts.path.rstrip("/")
    if any(c in prefix for c in " \r\n?#"):
        raise ValueError(f"not a path prefix: {parts.path!r}")
    tls = None
    if parts.scheme == "https":
        tls = tls_context(ca_file)
    elif ca_file is not None:
        raise ValueError("a CA file is for https:// URLs only")
    return Endpoint(parts.scheme, parts.hostname, port, prefix, tls, _proxy_for(parts, port))


def tls_context(ca_file: str | None) -> ssl.SSLContext:
    """Certificates verified, host names checked: against the system's trust store, or
    only against `ca_file` (PEM) when it is given."""
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ValueError) as exc:  # missing, unreadable, not PEM (ssl.SSLError)
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"CA file {ca_file}: {why}") from None


# The stdlib's reading of NO_PROXY (suffixes, "*", host:port), for the host given.
_bypass: Callable[[str, dict[str, str]], bool] = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]


def _proxy_for(parts: SplitResult, port: int) -> Proxy | None:
    """The proxy HTTPS_PROXY or HTTP_PROXY (either case) names for this URL's scheme,
    unless NO_PROXY covers its host."""
    assert parts.hostname is not None
    proxies = urllib.request.getproxies_environment()
    url = proxies.get(parts.scheme)
    if not url or _bypass(f"{parts.hostname}:{port}", proxies):
        return None
    if "://" not in url:
        url = f"http://{url}"
    proxy = urlsplit(url)
    proxy_port = url_port(proxy, 80)
    if proxy.scheme != "http" or not proxy.hostname or not proxy_port:
        name = f"{parts.scheme.upper()}_PROXY"
        raise ValueError(f"{name} must be an http://HOST:PORT proxy, got {url!r}")
    authorization = ""
    if proxy.username is not None:
        pair = f"{unquote(proxy.username)}:{unquote(proxy.password or '')}"
        authorization = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
    return Proxy(proxy.hostname, proxy_port, authorization)


def connection_error(exc: BaseException, where: str) -> ConnectionError:
    """A ConnectionError naming the server (ConnectionRefusedError and the like keep their
    type); a certificate that is not trusted says so, and what to give to trust it."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = exc.verify_message or exc.reason or str(exc)
        return ConnectionError(
            f"{where}: its TLS certificate is not trusted ({why}); "
            "ca_file= (--ca-file) names the CA to trust"
        )
    if isinstance(exc, ssl.SSLError):
        return ConnectionError(f"{where}: TLS failed: {exc.reason or exc}")
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    kind = type(exc) if isinstance(exc, ConnectionError) and type(exc) is not Stale else None
    return (kind or ConnectionError)(f"{where}: {why or type(exc).__name__}")
