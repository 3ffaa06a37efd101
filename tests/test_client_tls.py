"""HTTPS, path prefixes and proxies end to end: a controller serving TLS (http_tls) with a
throwaway CA made by openssl, the client library (blocking and async, trio and asyncio)
and a poller (worker --hub https://... --ca-file) against it; a controller behind a small
reverse proxy that serves it under /jobs-api/; a CONNECT proxy named by HTTPS_PROXY or
HTTP_PROXY, and skipped for hosts NO_PROXY names."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import h11
import pytest
import trio

from controller.client import AsyncClient, Client, ControllerError
from tests.helpers import LiveController, live_controller, reap, wait_for_condition

# ---------------------------------------------------------------- a throwaway CA


@dataclass
class Pki:
    ca: Path  # the CA that signed the controller's certificate
    cert: Path
    key: Path
    other_ca: Path  # a CA that signed nothing here


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_ca(tmp: Path, name: str) -> None:
    _openssl(
        *["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"],
        *["-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN={name}"],
        cwd=tmp,
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    tmp = tmp_path_factory.mktemp("pki")
    _make_ca(tmp, "ca")
    _make_ca(tmp, "other")
    (tmp / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(
        *["req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key"],
        *["-out", "server.csr", "-subj", "/CN=127.0.0.1"],
        cwd=tmp,
    )
    _openssl(
        *["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key"],
        *["-CAcreateserial", "-days", "2", "-out", "server.pem", "-extfile", "san.ext"],
        cwd=tmp,
    )
    return Pki(tmp / "ca.pem", tmp / "server.pem", tmp / "server.key", tmp / "other.pem")


def poller(hub: str, *args: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "worker", "--log-level", "WARNING", "--hub", hub, *args]
    return subprocess.Popen(cmd, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def tls_live(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[LiveController]:
    """A controller serving HTTPS with no local workers: every job here is run by a poller
    that reached it over https with --ca-file."""
    tmp = tmp_path_factory.mktemp("tls")
    tls = {"cert": str(pki.cert), "key": str(pki.key)}
    with live_controller(tmp, "--workers", "0", ca_file=pki.ca, http_tls=tls) as ctl:
        assert ctl.url.startswith("https://")
        proc = poller(ctl.url, "--ca-file", str(pki.ca), "--name", "tls-poller", "--pulse", "0.5")
        try:
            yield ctl
        finally:
            proc.terminate()
            reap(proc)


# ---------------------------------------------------------------- TLS


def test_client_and_a_poller_over_https_run_a_job(tls_live: LiveController, pki: Pki) -> None:
    with Client(tls_live.url, ca_file=str(pki.ca)) as client:
        job = client.submit("over tls")
        assert job.result(timeout=30) == b"over tls"
        assert client.get(job.id).info["worker"] == "tls-poller"  # the poller over https ran it


def test_async_client_over_https_under_trio_and_asyncio(tls_live: LiveController, pki: Pki) -> None:
    async def round_trip(text: str) -> bytes:
        async with AsyncClient(tls_live.url, ca_file=str(pki.ca)) as client:
            job = await client.submit(text)
            return await job.result(timeout=30)

    assert trio.run(round_trip, "trio") == b"trio"
    assert asyncio.run(round_trip("asyncio")) == b"asyncio"


def test_the_console_over_https_sets_secure_cookies(tls_live: LiveController, pki: Pki) -> None:
    context = ssl.create_default_context(cafile=pki.ca)
    with urllib.request.urlopen(f"{tls_live.url}/", timeout=10, context=context) as resp:
        assert resp.status == 200
        assert "text/html" in resp.headers["Content-Type"]
        assert b"<html" in resp.read().lower()
        cookie = resp.headers["Set-Cookie"]
        assert cookie.startswith("console_browser=") and cookie.endswith("; Secure")


def test_jobctl_over_https_trusts_its_ca_file(tls_live: LiveController, pki: Pki) -> None:
    with Client(tls_live.url, ca_file=str(pki.ca)) as client:
        job = client.submit("over tls", id="jobctl-tls")
        assert job.result(timeout=20) == b"over tls"
    jobctl = [sys.executable, "-m", "controller.client.jobctl", "--url", tls_live.url]
    shown = subprocess.run(
        [*jobctl, "--ca-file", str(pki.ca), "show", "jobctl-tls", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["result"] == "over tls"
    for trust in ([], ["--ca-file", str(pki.other_ca)]):
        refused = subprocess.run(
            [*jobctl, *trust, "show", "jobctl-tls"], capture_output=True, text=True, timeout=60
        )
        assert refused.returncode == 3 and refused.stdout == ""
        assert "TLS certificate is not trusted" in refused.stderr
        assert len(refused.stderr.splitlines()) == 1


def test_an_untrusted_certificate_is_refused_with_a_clear_error(
    tls_live: LiveController, pki: Pki
) -> None:
    for ca_file in (None, str(pki.other_ca)):  # the system's trust store, another CA
        with (
            Client(tls_live.url, ca_file=ca_file) as client,
            pytest.raises(ConnectionError, match="TLS certificate is not trusted") as info,
        ):
            client.submit("x")
        assert tls_live.url in str(info.value) and "--ca-file" in str(info.value)

    async def async_attempt() -> None:
        async with AsyncClient(tls_live.url, ca_file=str(pki.other_ca)) as client:
            await client.submit("x")

    with pytest.raises(ConnectionError, match="TLS certificate is not trusted"):
        trio.run(async_attempt)


def test_a_poller_refused_by_the_certificate_says_why(
    tls_live: LiveController, pki: Pki, tmp_path: Path
) -> None:
    log = tmp_path / "poller.log"
    cmd = [sys.executable, "-m", "worker", "--hub", tls_live.url, "--ca-file", str(pki.other_ca)]
    with log.open("wb") as sink:
        proc = subprocess.Popen([*cmd, "--name", "untrusting"], stderr=sink)
    try:
        wait_for_condition(lambda: "not trusted" in log.read_text(), 20)
        assert "TLS certificate is not trusted" in log.read_text()
    finally:
        proc.terminate()
        reap(proc)


def test_a_certificate_that_cannot_be_loaded_stops_the_start(tmp_path: Path, pki: Pki) -> None:
    config = tmp_path / "c.json"
    for cert, key in ((pki.cert, tmp_path / "missing.key"), (pki.cert, pki.other_ca)):
        settings = {
            "journal": None,
            "socket_dir": str(tmp_path),
            "http_address": {"host": "127.0.0.1", "port": 0},
            "http_tls": {"cert": str(cert), "key": str(key)},
        }
        config.write_text(json.dumps(settings))
        proc = subprocess.run(
            [sys.executable, "-m", "controller", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2
        assert f"http_tls: cannot load the certificate {cert} with the key {key}" in proc.stderr
        assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- a path prefix


def _accept_in_threads(sock: socket.socket, serve: Callable[[socket.socket], None]) -> None:
    """Serve each connection `sock` accepts on a thread of its own, until it is closed."""

    def accept() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()


class ReverseProxy:
    """Serves the controller at http://127.0.0.1:PORT/jobs-api/...: each request's path is
    taken off its prefix and sent on to the controller (h11 on both sides, kept
    connections); a request outside the prefix gets 404 here."""

    PREFIX = b"/jobs-api"

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        assert parts.hostname and parts.port
        self.upstream = (parts.hostname, parts.port)
        self.forwarded: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/jobs-api/"
        _accept_in_threads(self.sock, self._serve)

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError, h11.ProtocolError):
            down = h11.Connection(h11.SERVER)
            up_sock = socket.create_connection(self.upstream)
            with up_sock:
                up = h11.Connection(h11.CLIENT)
                while True:
                    request, body = _read_message(down, conn)
                    if request is None:
                        return
                    assert isinstance(request, h11.Request)
                    if not request.target.startswith(self.PREFIX + b"/"):
                        _send_message(down, conn, h11.Response(status_code=404, headers=[]), b"")
                    else:
                        target = request.target[len(self.PREFIX) :]
                        self.forwarded.append(target)
                        headers = [(k, v) for k, v in request.headers if k != b"content-length"]
                        headers.append((b"content-length", b"%d" % len(body)))
                        out = h11.Request(method=request.method, target=target, headers=headers)
                        _send_message(up, up_sock, out, body)
                        response, answer = _read_message(up, up_sock)
                        assert isinstance(response, h11.Response)
                        back = [(k, v) for k, v in response.headers if k != b"content-length"]
                        back.append((b"content-length", b"%d" % len(answer)))
                        reply = h11.Response(status_code=response.status_code, headers=back)
                        _send_message(down, conn, reply, answer)
                        up.start_next_cycle()
                    down.start_next_cycle()

    def close(self) -> None:
        self.sock.close()


def _read_message(
    conn: h11.Connection, sock: socket.socket
) -> tuple[h11.Request | h11.Response | None, bytes]:
    head = None
    body = b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(sock.recv(65536))
        elif isinstance(event, h11.Request | h11.Response):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return head, body
        elif isinstance(event, h11.ConnectionClosed):
            return None, b""


def _send_message(
    conn: h11.Connection, sock: socket.socket, head: h11.Request | h11.Response, body: bytes
) -> None:
    data = conn.send(head) + (conn.send(h11.Data(data=body)) if body else b"")
    sock.sendall(data + conn.send(h11.EndOfMessage()))


@pytest.fixture(scope="module")
def plain_live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveController]:
    with live_controller(tmp_path_factory.mktemp("plain"), "--workers", "1") as ctl:
        yield ctl


def test_a_path_prefix_puts_every_request_under_it(plain_live: LiveController) -> None:
    proxy = ReverseProxy(plain_live.url)
    try:
        with Client(proxy.url) as client:
            job = client.submit("prefixed", id="under-prefix")
            assert job.result(timeout=30) == b"prefixed"
            assert client.get("under-prefix").state == "finished"

        async def async_round() -> bytes:
            async with AsyncClient(proxy.url.rstrip("/")) as client:  # with or without "/"
                return await (await client.submit("async prefixed")).result(timeout=30)

        assert trio.run(async_round) == b"async prefixed"
        assert b"/job/" in proxy.forwarded and b"/job/under-prefix/" in proxy.forwarded
        with Client(proxy.url.removesuffix("jobs-api/")) as outside:  # no prefix: the proxy's 404
            with pytest.raises(ControllerError) as info:
                outside.submit("x")
            assert info.value.status == 404
    finally:
        proxy.close()


# ---------------------------------------------------------------- a CONNECT proxy


@dataclass
class ConnectProxy:
    """Opens CONNECT tunnels and counts them; `refuse` answers 403 instead."""

    refuse: bool = False
    tunnels: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        _accept_in_threads(self.sock, self._serve)

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                head += chunk
            method, target, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
            if method != "CONNECT" or self.refuse:
                conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                return
            host, _, port = target.rpartition(":")
            self.tunnels.append(target)
            with socket.create_connection((host.strip("[]"), int(port))) as upstream:
                conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                pump = threading.Thread(target=_pump, args=(upstream, conn), daemon=True)
                pump.start()
                _pump(conn, upstream)
                pump.join(timeout=5)

    def close(self) -> None:
        self.sock.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)


@pytest.fixture
def connect_proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[ConnectProxy]:
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    proxy = ConnectProxy()
    try:
        yield proxy
    finally:
        proxy.close()


def test_https_goes_through_the_connect_proxy_https_proxy_names(
    tls_live: LiveController, pki: Pki, connect_proxy: ConnectProxy, monkeypatch
) -> None:
    authority = urlsplit(tls_live.url).netloc
    monkeypatch.setenv("HTTPS_PROXY", connect_proxy.url)
    with Client(tls_live.url, ca_file=str(pki.ca)) as client:
        assert client.submit("proxied").result(timeout=30) == b"proxied"
        assert client.submit("again").result(timeout=30) == b"again"
    # one tunnel, one TLS connection kept for all four requests
    assert connect_proxy.tunnels == [authority]

    async def async_round() -> bytes:
        async with AsyncClient(tls_live.url, ca_file=str(pki.ca)) as client:
            return await (await client.submit("async proxied")).result(timeout=30)

    before = len(connect_proxy.tunnels)
    assert trio.run(async_round) == b"async proxied"
    assert len(connect_proxy.tunnels) > before

    monkeypatch.setenv("NO_PROXY", "localhost,127.0.0.1")
    before = len(connect_proxy.tunnels)
    with Client(tls_live.url, ca_file=str(pki.ca)) as client:
        assert client.submit("direct").result(timeout=30) == b"direct"
    assert len(connect_proxy.tunnels) == before  # NO_PROXY: straight to the controller


def test_http_goes_through_the_proxy_http_proxy_names_and_a_refusal_is_clear(
    plain_live: LiveController, connect_proxy: ConnectProxy, monkeypatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", connect_proxy.url)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # not for http:// URLs
    with Client(plain_live.url) as client:
        assert client.submit("plain proxied").result(timeout=30) == b"plain proxied"
    assert connect_proxy.tunnels
    connect_proxy.refuse = True
    with (
        Client(plain_live.url) as client,
        pytest.raises(ConnectionError, match=r"refused CONNECT 127\.0\.0\.1:\d+: 403 Forbidden"),
    ):
        client.submit("x")


def test_a_poller_goes_through_the_proxy_too(
    plain_live: LiveController, connect_proxy: ConnectProxy
) -> None:
    env_proxy = {"HTTP_PROXY": connect_proxy.url}
    cmd = [sys.executable, "-m", "worker", "--log-level", "WARNING", "--hub", plain_live.url]
    proc = subprocess.Popen(
        [*cmd, "--name", "proxied-poller"],
        stderr=subprocess.DEVNULL,
        env={**_clean_env(), **env_proxy},
    )
    try:
        wait_for_condition(lambda: bool(connect_proxy.tunnels), 20)
    finally:
        proc.terminate()
        reap(proc)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
