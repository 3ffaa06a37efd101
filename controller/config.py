"""The one place the configuration is read and validated (docs/operations.md lists every key).

The file is a JSON object; every key is optional and has the default below.
Anything wrong (an unreadable file, bad JSON, an unknown key, a wrong type, a
value out of range) is one `ConfigError` whose message names the file and the
key; the commands print it and exit with status 2. Command-line flags are
applied on top with `Config.replace`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from controller.errors import CannotStart
from controller.job_ids import DoorName
from controller.joblimits import NO_LIMITS, JobLimits, LimitError, parse_limits
from controller.options import MAX_RETRY_DELAY, JobOptions
from controller.schedules import Schedule, parse_entries
from controller.wire import DEFAULT_MAX_EXTRA_SIZE

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class ConfigError(CannotStart):
    """A configuration problem, already phrased for the operator."""


@dataclass(frozen=True)
class ClientAddress:
    host: str = "0.0.0.0"
    port: int = 5555


@dataclass(frozen=True)
class RedisSettings:
    url: str = "redis://127.0.0.1:6379/0"
    stream: str = "jobs"
    group: str = "controllers"
    consumer: str | None = None  # None: the host name plus the socket directory
    claim_after: float = 60.0


@dataclass(frozen=True)
class HttpTls:
    """The HTTP door's certificate (chain) and private key, PEM files."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class Config:
    socket_dir: Path = Path("/run/controller")
    client_address: ClientAddress = field(default_factory=ClientAddress)
    allowed_clients: tuple[IPNetwork, ...] = (
        ipaddress.ip_network("127.0.0.0/8"),
        ipaddress.ip_network("::1/128"),
    )
    timeout_task_placement: float = 30.0
    max_retries: int = 3
    task_timeout: float = 0.0
    dial_timeout: float = 2.0
    result_retention: float = 3600.0
    notify_retries: int = 8
    max_extra_size: int = DEFAULT_MAX_EXTRA_SIZE
    journal: Path | None = Path("/var/lib/controller/journal.sqlite3")
    # "full": an acknowledged job survives a power loss (an fsync per commit); "normal": it
    # survives a controller crash or kill -9, not a power loss (WAL, no fsync per commit).
    journal_sync: str = "full"
    allowed_uids: tuple[int, ...] = (0,)
    # The HTTP job API and the console (host, port); None: off.
    http_address: ClientAddress | None = None
    # One bearer token a line; None: no token needed.
    http_token_file: Path | None = None
    allowed_calculators: tuple[IPNetwork, ...] = (
        ipaddress.ip_network("127.0.0.0/8"),
        ipaddress.ip_network("::1/128"),
    )
    calculator_timeout: float = 5.0
    claim_timeout: float = 300.0
    lease_timeout: float = 30.0
    redis: RedisSettings | None = None
    # Prometheus endpoint (host, port); None: no endpoint.
    metrics_address: ClientAddress | None = None
    # Open HTTP connections at most; a connection past it is accepted and closed at once.
    max_connections: int = 1000
    # Seconds an HTTP request may take from its first byte to its last.
    http_body_timeout: float = 30.0
    # Bytes of `log` text kept per job (the oldest entries go first).
    max_log_size: int = 65536
    # Bytes of encoded answers the UDP door holds for repeats and retained results.
    udp_memory: int = 67108864
    # The HTTP door over TLS with this certificate and key; None: plain HTTP.
    http_tls: HttpTls | None = None
    # Seconds before a failed job's first retry (doubled at each further one, with jitter).
    retry_delay: float = 0.0
    # Bytes of output (what a job wrote to stderr) kept per job: the newest.
    output_retention: int = 1048576
    # Open HTTP connections from one IP address at most (one client cannot lock out the rest).
    max_connections_per_client: int = 64
    # Jobs not yet ended, and the bytes of their payloads, at most: past either a new job is
    # refused (HTTP 503, UDP `busy`, the Redis door reads no more).
    max_pending: int = 1000000
    max_pending_bytes: int = 1073741824
    # Who a local slot's `--exec` jobs run as (DESIGN.md section 15): None (the worker's own
    # user), a name pattern with {slot}, or one name or uid per slot.
    job_users: str | tuple[str, ...] | None = None
    # Ceilings for one job; a job's `limits` option may ask for less, never more.
    job_limits: JobLimits = NO_LIMITS

    def job_user(self, slot: int) -> str | None:
        """The job user of local worker slot `slot` (None: jobs run as the worker's user);
        IndexError when a list names fewer users than there are slots."""
        users = self.job_users
        if users is None:
            return None
        if isinstance(users, str):
            return users.replace("{slot}", str(slot))
        return users[slot]

    def job_options(self, door: DoorName) -> JobOptions:
        """The options of a job from `door` that gives none: UDP jobs wait at most
        timeout_task_placement for a worker, the others without limit; the owner is the
        door's name (the UDP door puts its client's address instead); the limits are
        job_limits (a job may ask for less)."""
        return JobOptions(
            max_retries=self.max_retries,
            retry_delay=self.retry_delay,
            timeout=self.task_timeout,
            placement_timeout=self.timeout_task_placement if door == DoorName.UDP else 0.0,
            owner=door,
            limits=self.job_limits,
        )

    # Periodic jobs (controller/schedules.py); names unique.
    schedules: tuple[Schedule, ...] = ()

    def replace(self, **changes: Any) -> Config:
        """A copy with `changes` applied (flags override the file)."""
        return dataclasses.replace(self, **changes)

    @property
    def main_socket(self) -> Path:
        return self.socket_dir / "main.sock"


# --- converters: each takes the JSON value and returns the typed one or raises ValueError ---


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _seconds(value: Any) -> float:
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"must be a number of seconds, got {value!r}")
    if value < 0:
        raise ValueError(f"must not be negative, got {value!r}")
    return float(value)


def _positive_seconds(value: Any) -> float:
    seconds = _seconds(value)
    if seconds == 0:
        raise ValueError("must be more than 0")
    return seconds


def _count(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"must be a whole number, got {value!r}")
    if value < 0:
        raise ValueError(f"must not be negative, got {value!r}")
    return value


def _size(value: Any) -> int:
    size = _count(value)
    if size == 0:
        raise ValueError("must be more than 0")
    return size


def _path(value: Any) -> Path:
    if not isinstance(value, str) or not value:
        raise ValueError(f"must be a non-empty path string, got {value!r}")
    if "\0" in value:  # no file name holds one: the system calls would refuse it later
        raise ValueError(f"must not hold a NUL character, got {value!r}")
    return Path(value)


def _optional_path(value: Any) -> Path | None:
    return None if value is None else _path(value)


def _client_address(value: Any) -> ClientAddress:
    if not isinstance(value, dict):
        raise ValueError(
            f'must be an object like {{"host": "0.0.0.0", "port": 5555}}, got {value!r}'
        )
    unknown = set(value) - {"host", "port"}
    if unknown:
        raise ValueError(f"unknown member {sorted(unknown)[0]!r} (expected host, port)")
    host = value.get("host", ClientAddress.host)
    port = value.get("port", ClientAddress.port)
    if not isinstance(host, str) or not host:
        raise ValueError(f"host must be a non-empty string, got {host!r}")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"port must be a whole number from 0 to 65535, got {port!r}")
    return ClientAddress(host, port)


def _optional_address(value: Any) -> ClientAddress | None:
    return None if value is None else _client_address(value)


def _networks(value: Any) -> tuple[IPNetwork, ...]:
    if not isinstance(value, list):
        raise ValueError(f'must be a list of CIDR strings like ["127.0.0.0/8"], got {value!r}')
    networks = []
    for item in value:
        if not isinstance(item, str):
            raise ValueError(f"each entry must be a CIDR string, got {item!r}")
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"{item!r} is not an IP network in CIDR form") from None
    return tuple(networks)


def _redis(value: Any) -> RedisSettings | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f'must be null or an object like {{"url": "redis://..."}}, got {value!r}')
    fields = [f.name for f in dataclasses.fields(RedisSettings)]
    unknown = set(value) - set(fields)
    if unknown:
        raise ValueError(f"unknown member {sorted(unknown)[0]!r} (expected {', '.join(fields)})")
    for name in ("url", "stream", "group"):
        if name in value and (not isinstance(value[name], str) or not value[name]):
            raise ValueError(f"{name} must be a non-empty string, got {value[name]!r}")
    consumer = value.get("consumer")
    if consumer is not None and (not isinstance(consumer, str) or not consumer):
        raise ValueError(f"consumer must be null or a non-empty string, got {consumer!r}")
    settings = dict(value)
    if "claim_after" in settings:
        try:
            settings["claim_after"] = _positive_seconds(settings["claim_after"])
        except ValueError as exc:
            raise ValueError(f"claim_after {exc}") from None
    return RedisSettings(**settings)


def _http_tls(value: Any) -> HttpTls | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"cert", "key"}:
        raise ValueError(f'must be null or {{"cert": FILE, "key": FILE}}, got {value!r}')
    for name in ("cert", "key"):
        try:
            _path(value[name])
        except ValueError:
            raise ValueError(f"{name} must be a file name, got {value[name]!r}") from None
    return HttpTls(Path(value["cert"]), Path(value["key"]))


def _retry_delay(value: Any) -> float:
    seconds = _seconds(value)
    if seconds > MAX_RETRY_DELAY:
        raise ValueError(f"must be at most {MAX_RETRY_DELAY:g} seconds, got {value!r}")
    return seconds


JOURNAL_SYNC_MODES = ("full", "normal")


def _journal_sync(value: Any) -> str:
    if value not in JOURNAL_SYNC_MODES:
        raise ValueError(f'must be "full" or "normal", got {value!r}')
    return str(value)


def _uids(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"must be a list of numeric uids, got {value!r}")
    return tuple(_count(item) for item in value)


def _job_users(value: Any) -> str | tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        if "{slot}" not in value:
            raise ValueError(
                f'must be a name pattern holding {{slot}} like "controller-job-{{slot}}", '
                f"a list of names or uids, or null; got {value!r}"
            )
        _user_name(value.replace("{slot}", "0"))
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"must be null, a name pattern with {{slot}}, or a non-empty list of names or uids, "
            f"got {value!r}"
        )
    users = []
    for item in value:
        if isinstance(item, int) and not isinstance(item, bool):
            if not 1 <= item < 2**32 - 1:
                raise ValueError(f"uid {item!r} must be from 1 to {2**32 - 2}")
            users.append(str(item))
        elif isinstance(item, str):
            users.append(_user_name(item))
        else:
            raise ValueError(f"each entry must be a user name or a uid, got {item!r}")
    if len(set(users)) != len(users):
        raise ValueError("names the same user twice: each slot needs a user of its own")
    return tuple(users)


def _user_name(name: str) -> str:
    """A user name or a uid as digits (never root: jobs must not run as uid 0)."""
    if name.isascii() and name.isdigit():
        uid = int(name)
        if not 1 <= uid < 2**32 - 1:
            raise ValueError(f"uid {name!r} must be from 1 to {2**32 - 2}")
        return str(uid)
    if (
        not name
        or len(name) > 32
        or not name.isascii()
        or name[0] == "-"
        or not all(c.isalnum() or c in "._-" for c in name)
    ):
        raise ValueError(f"{name!r} is not a user name (letters, digits, '.', '_', '-')")
    if name == "root":
        raise ValueError("jobs must never run as root")
    return name


def _job_limits(value: Any) -> JobLimits:
    try:
        return parse_limits(value)
    except LimitError as exc:
        raise ValueError(str(exc)) from None


_CONVERTERS: dict[str, Callable[[Any], Any]] = {
    "socket_dir": _path,
    "client_address": _client_address,
    "allowed_clients": _networks,
    "timeout_task_placement": _positive_seconds,
    "max_retries": _count,
    "task_timeout": _seconds,
    "dial_timeout": _positive_seconds,
    "result_retention": _seconds,
    "notify_retries": _count,
    "max_extra_size": _size,
    "journal": _optional_path,
    "journal_sync": _journal_sync,
    "allowed_uids": _uids,
    "http_address": _optional_address,
    "http_token_file": _optional_path,
    "allowed_calculators": _networks,
    "calculator_timeout": _positive_seconds,
    "claim_timeout": _positive_seconds,
    "lease_timeout": _positive_seconds,
    "redis": _redis,
    "metrics_address": _optional_address,
    "max_connections": _size,
    "http_body_timeout": _positive_seconds,
    "max_log_size": _size,
    "udp_memory": _size,
    "http_tls": _http_tls,
    "retry_delay": _retry_delay,
    "schedules": parse_entries,
    "output_retention": _size,
    "max_connections_per_client": _size,
    "max_pending": _size,
    "max_pending_bytes": _size,
    "job_users": _job_users,
    "job_limits": _job_limits,
}


def parse_config(data: Any, source: str = "<config>") -> Config:
    """Validate an already-decoded JSON value; `source` names it in errors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the configuration must be a JSON object")
    values: dict[str, Any] = {}
    for key, raw in data.items():
        convert = _CONVERTERS.get(key)
        if convert is None:
            known = ", ".join(sorted(_CONVERTERS))
            raise ConfigError(f"{source}: unknown key {key!r} (known keys: {known})")
        try:
            values[key] = convert(raw)
        except ValueError as exc:
            raise ConfigError(f"{source}: key {key!r} {exc}") from None
    return Config(**values)


def load_config(path: str | Path | None) -> Config:
    """Read the JSON file at `path` (None: all defaults)."""
    if path is None:
        return Config()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{path}: cannot read the configuration file: {reason}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{path}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    return parse_config(data, str(path))


def secret_files(config: Config, source: str | Path | None) -> list[tuple[Path, str]]:
    """The files that hold a secret, each with what it holds: `http_token_file`, and the
    configuration file `source` itself when its Redis URL carries a password."""
    found = []
    if config.http_token_file is not None:
        found.append((config.http_token_file, "http_token_file"))
    if source is not None and config.redis is not None:
        try:
            password = urlsplit(config.redis.url).password
        except ValueError:
            password = None
        if password:
            found.append((Path(source), "a Redis password"))
    return found
