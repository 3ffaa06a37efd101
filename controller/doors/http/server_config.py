"""How the HTTP door's hypercorn server is set up: where it listens, TLS, its keep-alive wait
beside the door's own idle timer (keepalive.py), and its logs."""

from __future__ import annotations

import logging

from hypercorn.config import Config as HypercornConfig

from controller.config import Config
from controller.doors.http import keepalive


def hypercorn_config(config: Config, idle_timeout: float, own_idle_timer: bool) -> HypercornConfig:
    """hypercorn's settings for `config`'s http_address (and http_tls): a connection silent for
    `idle_timeout` is closed (`own_idle_timer`: keepalive.py's timer waits its GRACE first)."""
    address = config.http_address
    assert address is not None
    hc = HypercornConfig()
    host = f"[{address.host}]" if ":" in address.host else address.host
    hc.bind = [f"{host}:{address.port}"]
    tls = config.http_tls
    if tls is not None:  # hypercorn then serves bind with TLS (and nothing in clear)
        hc.certfile, hc.keyfile = str(tls.cert), str(tls.key)
        hc.alpn_protocols = ["http/1.1"]  # the app speaks HTTP/1.1 only
        # A connection that does not finish its handshake holds a slot no longer than an idle
        # one would.
        hc.ssl_handshake_timeout = idle_timeout
    # hypercorn's own keep-alive wait starts after keepalive.GRACE idle (keepalive.py)
    hc.keep_alive_timeout = idle_timeout - (keepalive.GRACE if own_idle_timer else 0.0)
    hc.include_server_header = False  # a header per answer that tells nobody anything
    hc.accesslog = None
    server_log = logging.getLogger("controller.http.server")
    server_log.setLevel(logging.WARNING)  # its "Running on ..." repeats our own line
    hc.errorlog = server_log
    hc.backlog = 1024
    return hc
