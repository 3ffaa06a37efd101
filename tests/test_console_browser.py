"""The console in a real browser (Debian's chromium through chromium-driver and Selenium):
log in, filter, open a job, retry, cancel, pause, follow a job's output, the chart.

One controller and one browser for the module. With SAVE_SCREENSHOTS=1 each page's picture
is written to docs/img/ (console-*.png), the ones the documentation shows.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import LiveController, live_controller, wait_for_condition

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
try:
    from selenium import webdriver
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support.ui import Select, WebDriverWait
except ImportError:  # pragma: no cover - the test extras install it
    webdriver = None  # type: ignore[assignment]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        webdriver is None, reason="selenium is not installed (pip install -e .[test])"
    ),
    pytest.mark.skipif(
        CHROMIUM is None or CHROMEDRIVER is None,
        reason="no chromium or chromedriver here (.ci/run and make test install Debian's "
        "chromium and chromium-driver when root)",
    ),
]

TOKEN = "browser-token"
SHOTS = Path(__file__).resolve().parent.parent / "docs" / "img"
# A job's payload says what it does: "fail..." fails; "slow:FILE" writes a line to stderr
# every 0.2 s until FILE exists; anything else is echoed back.
SCRIPT = """#!/bin/sh
p=$(cat)
case "$p" in
  fail*) echo "it failed: $p" >&2; exit 3;;
  slow:*) f=${p#slow:}; i=0
    while [ ! -e "$f" ] && [ $i -lt 300 ]; do i=$((i+1)); echo "line $i" >&2; sleep 0.2; done
    echo done;;
  *) printf %s "$p";;
esac
"""


@dataclass
class Console:
    ctl: LiveController
    driver: WebDriver
    tmp: Path

    def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.ctl.url + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=20) as resp:
                raw = resp.read()
                kind = resp.headers.get("content-type", "")
                return resp.status, json.loads(raw) if "json" in kind else raw
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def open(self, path: str) -> None:
        self.driver.get(self.ctl.url + path)

    def wait(self, condition: Callable[[WebDriver], Any], timeout: float = 15) -> Any:
        # A page being replaced (a form's answer, a live update) makes elements stale.
        ignored = (StaleElementReferenceException,)
        return WebDriverWait(self.driver, timeout, ignored_exceptions=ignored).until(condition)

    def click(self, css: str) -> None:
        """Click a button that a live update may replace under us (then find it again)."""

        def clicked(driver: WebDriver) -> bool:
            try:
                driver.find_element(By.CSS_SELECTOR, css).click()
                return True
            except StaleElementReferenceException:
                return False

        self.wait(clicked)

    def log_in(self) -> None:
        self.open("/ui/login")
        if self.driver.find_elements(By.NAME, "token"):
            self.driver.find_element(By.NAME, "token").send_keys(TOKEN)
            self.click("form.login button")
        self.wait(lambda d: "Log out" in d.page_source)

    def text(self) -> str:
        return str(self.driver.find_element(By.TAG_NAME, "body").text)

    def shot(self, name: str) -> None:
        if os.environ.get("SAVE_SCREENSHOTS") == "1":
            SHOTS.mkdir(parents=True, exist_ok=True)
            self.driver.save_screenshot(str(SHOTS / f"console-{name}.png"))

    def job(self, job_id: str) -> dict[str, Any]:
        status, job = self.api("GET", f"/job/{job_id}/")
        assert status == 200
        return dict(job)


def reached(moment: float) -> bool:
    return time.monotonic() >= moment


def spread_load(c: Console, seconds: int) -> None:
    """Some jobs each second for `seconds` (a few of them failing), for the screenshots."""
    start = time.monotonic()
    for second in range(seconds):
        wait_for_condition(functools.partial(reached, start + second), timeout=5)
        for n in range(2 + (second * 7) % 11):
            payload = "fail" if (second + n) % 9 == 0 else "ok"
            name = ("resize-image", "send-mail", "nightly-report")[n % 3]
            c.api("POST", "/job/", {"payload": payload, "name": name})


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    tmp: Path = tmp_path_factory.mktemp("console")
    script = tmp / "job.sh"
    script.write_text(SCRIPT)
    script.chmod(0o755)
    tokens = tmp / "tokens"
    tokens.write_text(TOKEN + "\n")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,1000",
        f"--user-data-dir={tmp / 'profile'}",
    ):
        options.add_argument(argument)
    service = webdriver.ChromeService(executable_path=str(CHROMEDRIVER))
    args = ("--workers", "2", "--", "--exec", str(script))
    with live_controller(tmp, *args, max_retries=0, http_token_file=str(tokens)) as ctl:
        try:
            driver = webdriver.Chrome(options=options, service=service)
        except WebDriverException as exc:
            pytest.skip(f"chromedriver could not start chromium: {exc.msg}")
        try:
            yield Console(ctl, driver, tmp)
        finally:
            driver.quit()


def test_log_in_see_the_chart_filter_open_retry_cancel_and_pause(console: Console) -> None:
    c = console
    c.open("/")
    assert "Log in" in c.text()  # the 401's body is the login form
    c.log_in()
    assert "Job controller" in c.text() and "Latest jobs" in c.text()
    for n in range(6):
        assert c.api("POST", "/job/", {"id": f"ok-{n}", "payload": f"fine {n}"})[0] == 201
    for n in range(2):
        body = {"id": f"fail-{n}", "payload": f"fail {n}", "name": "broken"}
        assert c.api("POST", "/job/", body)[0] == 201
    for n in range(3):  # no worker serves queue "other": they wait
        assert c.api("POST", "/job/", {"id": f"other-{n}", "queue": "other"})[0] == 201
    wait_for_condition(
        lambda: c.job("fail-1")["state"] == "failed" and c.job("ok-5")["state"] == "finished"
    )

    if os.environ.get("SAVE_SCREENSHOTS") == "1":
        spread_load(c, seconds=60)  # a chart worth a picture

    # The chart draws itself from /ui/stats: finished (green) over the axes.
    c.open("/")

    def green_pixels(driver: WebDriver) -> int:
        return int(
            driver.execute_script(
                "var c = document.getElementById('rate'); if (!c.dataset.drawn) return 0;"
                "var d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data, n = 0;"
                "for (var i = 0; i < d.length; i += 4)"
                "  if (d[i + 1] > 90 && d[i] < 90 && d[i + 2] < 110) n++;"
                "return n;"
            )
        )

    assert c.wait(green_pixels) > 100
    assert c.driver.find_element(By.ID, "rate").get_attribute("data-drawn") == "600"
    c.wait(lambda d: "finished" in d.find_element(By.ID, "latest").text)
    c.shot("overview")

    # Filter: the failed jobs.
    c.open("/ui/jobs")
    Select(c.driver.find_element(By.NAME, "state")).select_by_value("failed")
    c.click("form.filter button")
    c.wait(lambda d: "state=failed" in d.current_url)
    listed = c.driver.find_element(By.ID, "jobs-list").text
    assert "fail-0" in listed and "fail-1" in listed and "ok-0" not in listed
    assert "Retry all" in c.text()
    c.shot("jobs")

    # Open a failed job, retry it: a second attempt (that fails again).
    c.driver.find_element(By.LINK_TEXT, "fail-0").click()
    c.wait(lambda d: d.current_url.endswith("/ui/jobs/fail-0"))
    assert "it failed: fail 0" in c.text()
    c.shot("job")
    c.click('form[action="/ui/jobs/fail-0/retry"] button')
    wait_for_condition(lambda: c.job("fail-0")["attempts"] == 2)
    wait_for_condition(lambda: c.job("fail-0")["state"] == "failed")
    c.open("/ui/jobs/fail-0")
    assert c.driver.find_element(By.ID, "job-attempts").text.count("failed") >= 2

    # Cancel a running job.
    release = c.tmp / "release-runner"
    assert c.api("POST", "/job/", {"id": "runner", "payload": f"slow:{release}"})[0] == 201
    wait_for_condition(lambda: c.job("runner")["state"] == "working")
    c.open("/ui/jobs/runner")
    c.click('form[action="/ui/jobs/runner/cancel"] button')
    c.wait(lambda d: "canceled" in d.find_element(By.ID, "job-head").text)
    assert c.job("runner")["state"] == "canceled"
    # Its worker got RESTART; its supervisor starts it again.
    wait_for_condition(lambda: c.api("GET", "/health/")[1]["workers"] == 2, timeout=30)

    # Pause a queue, then resume it.
    c.open("/ui/queues")
    c.shot("queues")
    c.click('form[action="/ui/queues/other"] button')
    c.wait(lambda d: "paused" in d.find_element(By.ID, "queues").text)
    assert c.api("GET", "/queue/")[1]["other"]["paused"] is True
    c.click('form[action="/ui/queues/other"] button')
    wait_for_condition(lambda: c.api("GET", "/queue/")[1]["other"]["paused"] is False)

    c.open("/ui/workers")
    assert "local" in c.driver.find_element(By.ID, "workers").text
    c.shot("workers")


def test_a_jobs_output_is_followed_as_it_appears(console: Console) -> None:
    c = console
    release = c.tmp / "release-follow"
    assert c.api("POST", "/job/", {"id": "talker", "payload": f"slow:{release}"})[0] == 201
    wait_for_condition(lambda: c.job("talker")["state"] == "working")
    status, body = c.api("GET", "/job/talker/output")
    if status == 404 and b"no such path" in body:
        release.touch()
        pytest.skip("GET /job/{id}/output is not served by this controller yet")
    c.log_in()  # if the other test did not
    c.open("/ui/jobs/talker")
    pre = c.wait(lambda d: d.find_element(By.CSS_SELECTOR, ".output pre.live-output"))
    c.wait(lambda d: "line 2" in pre.text)
    seen = pre.text.count("line ")
    c.wait(lambda d: pre.text.count("line ") > seen + 2)  # it grows while the job runs
    release.touch()
    c.wait(lambda d: pre.get_attribute("data-ended") == "1", timeout=20)
    assert c.job("talker")["state"] == "finished"
