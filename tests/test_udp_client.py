"""udp-client's command line: --json lines, Ctrl-C summaries, the progress line, localhost."""

from __future__ import annotations

import io
import json
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from controller.client import udp_cli
from controller.client.udp_engine import Outcome
from controller.client.udp_output import Progress, outcome_json
from tests.helpers import free_udp_port, live_controller, run_udp_client, wait_for_condition


def test_json_prints_one_line_per_job_with_its_result(tmp_path: Path) -> None:
    with live_controller(tmp_path, "--workers", "2") as ctl:
        done = run_udp_client(ctl.udp_port, "add", "1-5", "--json", "--payload", "p")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert sorted(line["task_id"] for line in lines) == [1, 2, 3, 4, 5]
    for line in lines:
        assert line["status"] == "success" and line["result"] == "p"
        assert line["id"].startswith("udp-127.0.0.1-") and line["id"].endswith(
            f"-{line['task_id']}"
        )


def test_json_line_for_failures_and_binary_results() -> None:
    failed = json.loads(outcome_json(Outcome(7, "error", error="boom"), "udp-h-1-7"))
    assert failed == {"id": "udp-h-1-7", "task_id": 7, "status": "error", "error": "boom"}
    binary = json.loads(outcome_json(Outcome(8, "success", result=b"\xff"), "x"))
    assert binary["result_b64"] == "/w==" and "result" not in binary


def test_ctrl_c_during_a_batch_prints_the_summary_so_far(tmp_path: Path) -> None:
    with live_controller(tmp_path, "--workers", "1", "--", "--exec", "sleep", "0.05") as ctl:
        cmd = [
            sys.executable, "-m", "controller.client", "--server", f"127.0.0.1:{ctl.udp_port}",
            "add", "1-400", "--window", "2",
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

        def some_done() -> bool:
            return ctl_jobs_done(ctl.url) >= 3

        wait_for_condition(some_done, 30)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    text = err.decode()
    assert "interrupted after" in text and "of 400 tasks" in text
    assert "succeeded:" in text and "Traceback" not in text


def ctl_jobs_done(url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(f"{url}/job/?state=finished&limit=1000", timeout=5) as resp:
        return len(json.loads(resp.read()))


def test_progress_line_clears_what_it_overwrites() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    progress = Progress(2, stream)
    progress.step(True)
    progress.step(False)
    text = stream.getvalue()
    assert text.count("\r") == 2 and text.count("\x1b[K") == 2 and text.endswith("\n")


def test_a_name_with_several_addresses_uses_the_one_that_answers(monkeypatch) -> None:
    port = free_udp_port()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        server.bind(("127.0.0.1", port))

        def answer() -> None:
            _, addr = server.recvfrom(65535)
            server.sendto(b'{"method": "ack"}', addr)

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        both = [
            (socket.AF_INET6, socket.SOCK_DGRAM, 17, "", ("::1", port, 0, 0)),  # nobody there
            (socket.AF_INET, socket.SOCK_DGRAM, 17, "", ("127.0.0.1", port)),
        ]
        monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: both)
        assert udp_cli.resolve(("localhost", port)) == (socket.AF_INET, ("127.0.0.1", port))
        thread.join(5)


def test_unresolvable_server_is_a_usage_error() -> None:
    with pytest.raises(udp_cli.UsageError, match=r"no-such-host\.invalid"):
        udp_cli.resolve(("no-such-host.invalid", 5555))
