"""The systemd notification protocol, spoken directly (no libsystemd needed).

`NOTIFY_SOCKET` names a datagram socket (a path, or "@name" for the abstract
namespace); each message is newline-separated KEY=VALUE lines. Outside systemd
the variable is unset and every call does nothing.

The watchdog is fed from a task in the controller's own trio loop, and only
while that loop is healthy (its deadlines are not falling behind): a blocked or
wedged loop stops the pings, and systemd restarts the service.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping

import trio

log = logging.getLogger("controller.sdnotify")

# How far the scheduler may fall behind its own deadlines before the loop counts as unhealthy.
MAX_LAG = 5.0
# How often STATUS= is refreshed.
STATUS_INTERVAL = 2.0


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        self.address = "\0" + address[1:] if address.startswith("@") else address
        self._sock: socket.socket | None = None
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        wanted = usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid()))
        # Ping at half the interval, as sd_watchdog_enabled(3) advises.
        self.watchdog_interval = int(usec) / 2e6 if wanted else 0.0

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, message: str) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendto(message.encode(), self.address)
        except OSError as exc:
            log.debug("sd_notify %r failed: %s", message, exc)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def run(
        self,
        status: Callable[[], str],
        lag: Callable[[], float],
    ) -> None:
        """Keep STATUS= fresh and feed the watchdog while `lag()` stays under MAX_LAG."""
        if not self.enabled:
            return
        interval = min(STATUS_INTERVAL, self.watchdog_interval or STATUS_INTERVAL)
        next_status = 0.0
        while True:
            now = trio.current_time()
            if now >= next_status:
                self.notify(f"STATUS={status()}")
                next_status = now + STATUS_INTERVAL
            if self.watchdog_interval:
                behind = lag()
                if behind < MAX_LAG:
                    self.notify("WATCHDOG=1")
                else:
                    log.error(
                        "scheduler %.1f s behind its deadlines: not feeding the watchdog", behind
                    )
            await trio.sleep(interval)
