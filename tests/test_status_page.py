"""The console's overview in a real headless browser (Debian's chromium, no driver): a
screenshot and its text. tests/test_console_browser.py drives the rest with Selenium."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import live_controller, run_udp_client

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium here (.ci/run installs Debian's chromium package)"
)


def browser(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",  # CI runs as root
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp / 'profile'}",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_status_page_in_headless_chromium(tmp_path):
    with live_controller(tmp_path, "--workers", "2") as ctl:
        done = run_udp_client(ctl.udp_port, "add", "42", "--payload", "from-udp")
        assert done.returncode == 0, done.stderr
        request = urllib.request.Request(
            f"{ctl.url}/job/",
            data=b'{"id": "page-job", "name": "shown-on-the-page"}',
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status == 201
        shot = tmp_path / "status.png"
        taken = browser(
            "--window-size=1280,900", f"--screenshot={shot}", ctl.url + "/", tmp=tmp_path
        )
        assert taken.returncode == 0, taken.stderr[-2000:]
        assert shot.stat().st_size > 10_000  # a real picture, not an empty page
        dom = browser("--dump-dom", ctl.url + "/", tmp=tmp_path)
        assert dom.returncode == 0, dom.stderr[-2000:]
        text = dom.stdout
        for words in ("Job controller", "Workers", "local", "queue depth", "Latest jobs"):
            assert words in text, words
        assert "page-job" in text and "shown-on-the-page" in text
        assert "udp-127.0.0.1-" in text and "finished" in text
        assert text.count("<tr>") >= 1 + 2 + 1 + 2  # headers, two workers, two jobs
