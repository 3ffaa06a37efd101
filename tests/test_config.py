"""Config: a table of good and bad files with the expected value or message."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import pytest

from controller.config import (
    ClientAddress,
    Config,
    ConfigError,
    HttpTls,
    load_config,
    parse_config,
    secret_files,
)

GOOD = [
    ({}, "max_retries", 3),
    ({}, "journal", Path("/var/lib/controller/journal.sqlite3")),
    ({"journal": None}, "journal", None),
    ({}, "journal_sync", "full"),
    ({"journal_sync": "normal"}, "journal_sync", "normal"),
    ({"socket_dir": "/tmp/x"}, "socket_dir", Path("/tmp/x")),
    ({"client_address": {"port": 6000}}, "client_address", ClientAddress("0.0.0.0", 6000)),
    ({"timeout_task_placement": 1}, "timeout_task_placement", 1.0),
    ({"task_timeout": 0}, "task_timeout", 0.0),
    ({"dial_timeout": 0.25}, "dial_timeout", 0.25),
    ({"allowed_clients": ["10.0.0.0/8"]}, "allowed_clients", (ipaddress.ip_network("10.0.0.0/8"),)),
    ({"allowed_uids": [0, 1000]}, "allowed_uids", (0, 1000)),
    ({"max_extra_size": 1024}, "max_extra_size", 1024),
    ({"notify_retries": 0}, "notify_retries", 0),
    ({}, "metrics_address", None),
    (
        {"metrics_address": {"host": "127.0.0.1", "port": 9100}},
        "metrics_address",
        ClientAddress("127.0.0.1", 9100),
    ),
    ({}, "max_connections", 1000),
    ({}, "http_body_timeout", 30.0),
    ({}, "max_log_size", 65536),
    ({}, "udp_memory", 67108864),
    ({"max_connections": 8}, "max_connections", 8),
    ({"http_body_timeout": 0.5}, "http_body_timeout", 0.5),
    ({"max_log_size": 100}, "max_log_size", 100),
    ({"udp_memory": 4096}, "udp_memory", 4096),
    ({}, "http_tls", None),
    ({"http_tls": None}, "http_tls", None),
    (
        {"http_tls": {"cert": "/etc/c/cert.pem", "key": "/etc/c/key.pem"}},
        "http_tls",
        HttpTls(Path("/etc/c/cert.pem"), Path("/etc/c/key.pem")),
    ),
]

BAD = [
    ({"sockets_dir": "/x"}, "unknown key 'sockets_dir'"),
    ({"max_retries": "3"}, "key 'max_retries' must be a whole number"),
    ({"max_retries": True}, "key 'max_retries' must be a whole number"),
    ({"max_retries": -1}, "key 'max_retries' must not be negative"),
    ({"timeout_task_placement": -5}, "key 'timeout_task_placement' must not be negative"),
    ({"timeout_task_placement": 0}, "key 'timeout_task_placement' must be more than 0"),
    ({"task_timeout": "soon"}, "key 'task_timeout' must be a number of seconds"),
    ({"dial_timeout": 0}, "key 'dial_timeout' must be more than 0"),
    (
        {"client_address": {"host": "0.0.0.0", "port": 70000}},
        "port must be a whole number from 0 to 65535",
    ),
    ({"client_address": {"hots": "x"}}, "unknown member 'hots'"),
    ({"client_address": "0.0.0.0:5555"}, "key 'client_address' must be an object"),
    ({"allowed_clients": ["nonsense"]}, "'nonsense' is not an IP network"),
    ({"allowed_clients": "127.0.0.1"}, "key 'allowed_clients' must be a list"),
    ({"allowed_uids": [-1]}, "key 'allowed_uids' must not be negative"),
    ({"journal": 5}, "key 'journal' must be a non-empty path string"),
    ({"journal": "/var/lib/j\0x"}, "key 'journal' must not hold a NUL character"),
    ({"socket_dir": "/run/c\0"}, "key 'socket_dir' must not hold a NUL character"),
    ({"http_token_file": "\0"}, "key 'http_token_file' must not hold a NUL character"),
    ({"http_tls": {"cert": "c\0", "key": "k"}}, "cert must be a file name"),
    ({"max_extra_size": 0}, "key 'max_extra_size' must be more than 0"),
    ({"journal_sync": "off"}, 'key \'journal_sync\' must be "full" or "normal"'),
    ({"journal_sync": "FULL"}, 'key \'journal_sync\' must be "full" or "normal"'),
    ([1, 2], "must be a JSON object"),
    ({"metrics_address": 9100}, "key 'metrics_address' must be an object"),
    ({"max_connections": 0}, "key 'max_connections' must be more than 0"),
    ({"max_connections": "many"}, "key 'max_connections' must be a whole number"),
    ({"http_body_timeout": 0}, "key 'http_body_timeout' must be more than 0"),
    ({"max_log_size": -1}, "key 'max_log_size' must not be negative"),
    ({"udp_memory": 1.5}, "key 'udp_memory' must be a whole number"),
    ({"http_tls": "cert.pem"}, "key 'http_tls' must be null or {\"cert\": FILE"),
    ({"http_tls": {"cert": "c.pem"}}, "key 'http_tls' must be null or {\"cert\": FILE"),
    ({"http_tls": {"cert": "c.pem", "key": ""}}, "key 'http_tls' key must be a file name"),
    ({"http_tls": {"cert": 5, "key": "k.pem"}}, "key 'http_tls' cert must be a file name"),
]


def write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "controller.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("data", "key", "expected"), GOOD)
def test_good(tmp_path, data, key, expected):
    config = load_config(write(tmp_path, data))
    assert getattr(config, key) == expected


@pytest.mark.parametrize(("data", "message"), BAD)
def test_bad(tmp_path, data, message):
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_unreadable_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the configuration file"):
        load_config(tmp_path / "missing.json")


def test_bad_json_names_line(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{\n  "max_retries": 3,\n}')
    with pytest.raises(ConfigError, match="line 3"):
        load_config(path)


def test_defaults_without_file():
    assert load_config(None) == Config()


def test_flags_override(tmp_path):
    config = load_config(write(tmp_path, {"socket_dir": "/a"})).replace(socket_dir=Path("/b"))
    assert config.main_socket == Path("/b/main.sock")


def test_packaged_configs_are_valid():
    root = Path(__file__).resolve().parent.parent / "packaging"
    for path in root.glob("*.json"):
        load_config(path)


def test_secret_files_are_the_token_file_and_a_config_with_a_redis_password():
    plain = parse_config({"redis": {"url": "redis://127.0.0.1:6379/0"}})
    assert secret_files(plain, "/etc/c.json") == []
    both = parse_config(
        {"http_token_file": "/etc/t", "redis": {"url": "redis://user:pw@127.0.0.1:6379/0"}}
    )
    assert secret_files(both, "/etc/c.json") == [
        (Path("/etc/t"), "http_token_file"),
        (Path("/etc/c.json"), "a Redis password"),
    ]
