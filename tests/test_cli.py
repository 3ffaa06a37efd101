"""The three commands: --help works, bad configuration is one clear line and exit 2."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from controller.cli import positive_seconds, quiet_pipe
from controller.main import build_parser


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    ("module", "words"),
    [
        ("controller", ["--workers", "--socket-dir", "--config"]),
        ("worker", ["--exec", "--handler", "--pulse", "--drain-timeout"]),
        ("controller.client", ["add", "--server"]),
    ],
)
def test_help(module, words):
    proc = run("-m", module, "--help")
    assert proc.returncode == 0, proc.stderr
    for word in words:
        assert word in proc.stdout


@pytest.mark.parametrize(
    ("module", "prog"),
    [("controller", "controller"), ("worker", "worker"), ("controller.client", "udp-client")],
)
def test_version(module, prog):
    from controller.cli import version

    proc = run("-m", module, "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{prog} {version()}"
    assert version()[0].isdigit()


def test_the_version_is_written_in_one_place_that_pyproject_reads():
    import tomllib
    from pathlib import Path

    import controller
    from controller.cli import version

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "controller.__version__"}
    assert version() == controller.__version__ == "0.2.0"


def test_help_points_at_documents_that_exist():
    from pathlib import Path

    from controller.cli import DOCS

    proc = run("-m", "controller", "--help")
    assert DOCS in proc.stdout.replace("\n", " ")
    assert (Path(__file__).parent.parent / DOCS).is_file()


def test_controller_bad_config_exit_2(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"max_retries": -1}')
    proc = run("-m", "controller", "--config", str(path))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"controller: {path}: key 'max_retries' must not be negative, got -1"
    ]


def test_controller_world_writable_socket_dir_exit_2(tmp_path):
    (tmp_path / "s").mkdir(mode=0o777)
    (tmp_path / "s").chmod(0o777)
    config = tmp_path / "c.json"
    config.write_text('{"journal": null}')  # the default one is root's
    proc = run("-m", "controller", "--config", str(config), "--socket-dir", str(tmp_path / "s"))
    assert proc.returncode == 2 and "world-writable" in proc.stderr


@pytest.mark.parametrize(
    ("settings", "line"),
    [
        (  # main.sock's path is longer than a Unix socket address holds
            {"socket_dir": "s/" + "d" * 120},
            "controller: socket_dir: cannot listen on {tmp}/s/{long}/main.sock: "
            "AF_UNIX path too long",
        ),
        (
            {"client_address": {"host": "192.0.2.1", "port": 0}},
            "controller: client_address: cannot listen for clients on 192.0.2.1:0: "
            "Cannot assign requested address",
        ),
    ],
)
def test_a_start_error_from_the_system_names_the_key(tmp_path, settings, line):
    if "socket_dir" in settings:
        settings = {"socket_dir": str(tmp_path / settings["socket_dir"])}
    config = tmp_path / "c.json"
    socket_dir = str(tmp_path / "sock")
    config.write_text(json.dumps({"journal": None, "socket_dir": socket_dir, **settings}))
    proc = run("-m", "controller", "--config", str(config))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [line.format(tmp=tmp_path, long="d" * 120)]


def test_controller_warns_once_when_a_secret_file_is_readable_by_others(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    config = tmp_path / "c.json"
    settings = {
        "http_token_file": str(token),
        "redis": {"url": "redis://:pw@127.0.0.1:1/0"},
        "journal": None,
    }
    config.write_text(json.dumps(settings))
    (tmp_path / "s").mkdir()
    (tmp_path / "s").chmod(0o777)  # stops the start right after the warnings (exit 2)
    for path in (token, config):
        path.chmod(0o644)
    proc = run("-m", "controller", "--config", str(config), "--socket-dir", str(tmp_path / "s"))
    assert proc.returncode == 2
    warnings = [line for line in proc.stderr.splitlines() if "readable by others" in line]
    assert len(warnings) == 2, proc.stderr
    assert f"{token} holds http_token_file" in warnings[0] and "mode 0644" in warnings[0]
    assert f"{config} holds a Redis password" in warnings[1]
    for path in (token, config):
        path.chmod(0o600)
    proc = run("-m", "controller", "--config", str(config), "--socket-dir", str(tmp_path / "s"))
    assert proc.returncode == 2 and "readable by others" not in proc.stderr


def test_worker_bad_config_exit_2(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("{not json")
    proc = run("-m", "worker", "--config", str(path))
    assert proc.returncode == 2 and "not valid JSON" in proc.stderr


def test_controller_corrupt_journal_exit_2_naming_path(tmp_path):
    journal = tmp_path / "journal.sqlite3"
    journal.write_bytes(b"garbage" * 1000)
    config = tmp_path / "c.json"
    settings = {
        "journal": str(journal),
        "socket_dir": str(tmp_path / "s"),
        "client_address": {"host": "127.0.0.1", "port": 0},
    }
    config.write_text(json.dumps(settings))
    proc = run("-m", "controller", "--config", str(config))
    assert proc.returncode == 2
    assert str(journal) in proc.stderr and "Traceback" not in proc.stderr


def test_logs_without_timestamps_under_systemd(monkeypatch, capsys):
    import logging

    from controller.cli import setup_logging

    monkeypatch.setenv("JOURNAL_STREAM", "8:1234")
    setup_logging("INFO", "controller")
    logging.getLogger("controller").info("hello")
    assert capsys.readouterr().err == "INFO controller: hello\n"
    monkeypatch.delenv("JOURNAL_STREAM")
    setup_logging("INFO", "controller")
    logging.getLogger("controller").info("hello")
    assert capsys.readouterr().err.endswith(f"INFO controller[{os.getpid()}] controller: hello\n")


@pytest.mark.parametrize("value", ["x", "-1", "1.5", "2000000", "Auto"])
def test_controller_bad_busy_poll_exit_2(value):
    proc = run("-m", "controller", "--busy-poll", value)
    assert proc.returncode == 2
    assert "--busy-poll" in proc.stderr
    assert "whole microseconds or 'auto'" in proc.stderr or "must be 0 to" in proc.stderr


def test_controller_busy_poll_default_is_adaptive():
    parser = build_parser()
    assert parser.parse_args([]).busy_poll is None  # auto
    assert parser.parse_args(["--busy-poll", "auto"]).busy_poll is None
    assert parser.parse_args(["--busy-poll", "0"]).busy_poll == 0.0
    assert parser.parse_args(["--busy-poll", "200"]).busy_poll == pytest.approx(200e-6)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--hub", "ftp://ctl:8080"], "expected an http[s]://HOST:PORT[/PREFIX/] URL"),
        (["--hub", "http://ctl:99999"], "expected an http[s]://HOST:PORT[/PREFIX/] URL"),
        (["--hub", "http://ctl:port"], "expected an http[s]://HOST:PORT[/PREFIX/] URL"),
        (["--hub", "https://ctl:1", "--ca-file", "/no/such/ca.pem"], "CA file /no/such/ca.pem"),
        (["--hub", "http://ctl:1", "--ca-file", "/no/such/ca.pem"], "https:// URLs only"),
        (["--hub", "http://127.0.0.1:9", "--token-file", "/no/such/token"], "/no/such/token"),
        (["--ca-file", "/etc/ssl/ca.pem"], "--ca-file goes with an https --hub"),
        (["--udp", "nohostport"], "expected HOST:PORT"),
        (["--udp", "h:99999"], "expected HOST:PORT"),
        (["--udp", "h:1", "--hub", "http://h:2"], "not allowed with argument"),
        (["--socket-dir", "/tmp", "--udp", "h:1"], "not allowed with argument"),
        (["--udp", "h:1", "--queues", "Gpu"], "argument --queues: a name must match"),
        (["--hub", "http://h:2", "--labels", "a b"], "argument --labels: a name must match"),
        (["--queues", ""], "argument --queues: give at least one queue"),
    ],
)
def test_remote_worker_bad_flags_are_one_line_and_exit_2(args, said):
    proc = run("-m", "worker", *args)
    assert proc.returncode == 2
    assert said in proc.stderr and "Traceback" not in proc.stderr


def test_controller_refuses_bad_worker_arguments_before_starting_workers(tmp_path):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"socket_dir": str(tmp_path / "s"), "journal": None}))
    proc = run("-m", "controller", "--config", str(config), "--workers", "1", "--", "--queues", "A")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        "controller: the workers' arguments (after --): argument --queues: "
        "a name must match [a-z0-9_.-]{1,64}, got 'A'"
    )
    assert not (tmp_path / "s").exists()  # it stopped before making anything


@pytest.mark.parametrize(
    ("text", "said"), [("\n", "holds no token"), ("s\u00e9cret\n", "printable ASCII")]
)
def test_unusable_token_file_is_refused(tmp_path, text, said):
    token = tmp_path / "token"
    token.write_text(text, encoding="utf-8")
    proc = run("-m", "worker", "--hub", "http://127.0.0.1:9", "--token-file", str(token))
    assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr


def test_the_controller_loads_optional_doors_libraries_only_when_configured():
    # hypercorn (HTTP), redis-py (Redis) and prometheus_client (metrics) are imported by
    # the door that uses them: a controller without them starts lighter (~15 MB of RSS).
    code = (
        "import sys, controller.main\n"
        "print(sorted(m for m in ('hypercorn', 'redis', 'prometheus_client') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------- udp-client add's job options


def test_udp_client_add_reads_every_job_option_flag_into_add_task_params():
    from controller.client.udp_cli import _payload, build_parser

    args = build_parser().parse_args(
        [
            "--timeout",
            "9",
            "add",
            "5",
            "--payload",
            "hi",
            "--queue",
            "gpu",
            "--priority",
            "-3",
            "--requires",
            "cuda, ssd",
            "--delay",
            "1.5",
            "--max-retries",
            "2",
            "--retry-delay",
            "10",
            "--timeout",
            "30",
            "--placement-timeout",
            "0.25",
        ]
    )
    assert args.timeout == 9  # before `add`: how long udp-client waits
    assert _payload(args) == {
        "payload": "hi",
        "queue": "gpu",
        "priority": -3,
        "requires": ["cuda", "ssd"],
        "delay": 1.5,
        "max_retries": 2,
        "retry_delay": 10,
        "timeout": 30,  # after `add`: the job's own
        "placement_timeout": 0.25,
    }
    plain = build_parser().parse_args(["add", "5"])
    assert _payload(plain) == {} and plain.timeout == 60


@pytest.mark.parametrize(
    ("flag", "value", "field"),
    [
        ("--queue", "No Spaces", "queue"),
        ("--priority", "101", "priority"),
        ("--priority", "high", "priority"),
        ("--requires", "gpu,GPU", "requires"),
        ("--delay", "-1", "delay"),
        ("--max-retries", "1000", "max_retries"),
        ("--retry-delay", "soon", "retry_delay"),
        ("--timeout", "inf", "timeout"),
        ("--placement-timeout", "-0.5", "placement_timeout"),
    ],
)
def test_udp_client_add_refuses_a_bad_option_with_the_controllers_message(flag, value, field):
    from controller.options import DEFAULT, BadOption, parse

    with pytest.raises(BadOption) as controller_says:
        parse({field: value}, DEFAULT, 0.0, text=True)
    proc = run("-m", "controller.client", "add", "5", flag, value)
    assert proc.returncode == 2, proc.stderr
    assert f"argument {flag}: {controller_says.value}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_udp_client_add_sends_the_options_with_the_task(tmp_path):
    from tests.test_client_wire import udp_peer

    with udp_peer() as peer:
        proc = run(
            "-m",
            "controller.client",
            "--server",
            f"127.0.0.1:{peer.port}",
            "add",
            "3-4",
            "--queue",
            "batch",
            "--requires",
            "ssd",
            "--timeout",
            "5",
        )
    assert proc.returncode == 0, proc.stderr
    sent = sorted((packet["params"] for packet in peer.packets), key=lambda p: p["task_id"])
    assert sent == [
        {"task_id": n, "queue": "batch", "requires": ["ssd"], "timeout": 5} for n in (3, 4)
    ]


@pytest.mark.parametrize("text", ["0", "-1", "nan", "soon", "", "inf-"])
def test_a_seconds_argument_that_is_not_above_zero_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        positive_seconds(text)


def test_a_seconds_argument_above_zero_is_read():
    assert positive_seconds("0.25") == 0.25
    assert positive_seconds("30") == 30.0


def test_a_reader_that_went_away_ends_the_command_with_141_and_no_traceback(monkeypatch):
    def main(argv):
        raise BrokenPipeError

    fds = []
    monkeypatch.setattr(os, "dup2", lambda fd, to: fds.append((fd, to)))
    assert quiet_pipe(main, []) == 141
    assert [to for _, to in fds] == [sys.stdout.fileno()]
    for fd, _ in fds:
        os.close(fd)
    assert quiet_pipe(lambda argv: 7, None) == 7


def test_the_client_library_and_the_worker_load_none_of_the_controllers_core():
    # They share the wire's vocabulary (datagram, wire, job_states, the doors' codecs), not
    # the job book or the scheduler: a client or a worker stays light.
    code = (
        "import sys, worker.main, controller.client.sync_client, controller.client.async_client\n"
        "import controller.client.redis_backend, controller.client.udp_cli\n"
        "print(sorted(m for m in ('controller.jobs', 'controller.core') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
