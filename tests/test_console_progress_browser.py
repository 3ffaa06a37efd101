"""The console's flows pages in a real browser (tests/test_console_browser.py's manner:
Debian's chromium through chromium-driver and Selenium): a job's progress bar moves as the job
reports, without a reload, and the jobs list shows it too; a batch's page and its `then` job,
waiting for the batch's jobs, link to each other and to those jobs."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import LiveController, live_controller
from tests.test_console_browser import CHROMEDRIVER, CHROMIUM
from tests.test_console_browser import pytestmark as browser_marks

try:
    from selenium import webdriver
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # pragma: no cover - the test extras install it
    webdriver = None  # type: ignore[assignment]

pytestmark = browser_marks

# The job's payload names a file; it reports 0.1, 0.2, ... every 0.3 s until the file exists.
SCRIPT = """#!/bin/sh
f=$(cat); i=1
while [ ! -e "$f" ] && [ $i -lt 10 ]; do
  echo "progress 0.$i step $i" >&"$JOB_PROGRESS_FD"; i=$((i+1)); sleep 0.3
done
while [ ! -e "$f" ]; do sleep 0.05; done
echo done
"""


def _post(ctl: LiveController, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(f"{ctl.url}/job/", json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=20) as resp:
        return dict(json.loads(resp.read()))


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[tuple[LiveController, WebDriver, Path]]:
    script = tmp_path / "job.sh"
    script.write_text(SCRIPT)
    script.chmod(0o755)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'profile'}",
    ):
        options.add_argument(argument)
    service = webdriver.ChromeService(executable_path=str(CHROMEDRIVER))
    with live_controller(tmp_path, "--workers", "1", "--", "--exec", str(script)) as ctl:
        try:
            driver = webdriver.Chrome(options=options, service=service)
        except WebDriverException as exc:
            pytest.skip(f"chromedriver could not start chromium: {exc.msg}")
        try:
            yield ctl, driver, tmp_path
        finally:
            driver.quit()


def _bar(driver: WebDriver, css: str) -> float:
    """The value of the first bar under `css` (-1: none yet)."""
    try:
        found = driver.find_elements(By.CSS_SELECTOR, f"{css} progress.bar")
        return float(found[0].get_attribute("value") or -1) if found else -1.0
    except StaleElementReferenceException:  # a live update replaced it under us
        return -1.0


def test_the_bar_moves_on_the_jobs_page_and_shows_in_the_list(
    browser: tuple[LiveController, WebDriver, Path],
) -> None:
    ctl, driver, tmp = browser
    gate = tmp / "gate"
    _post(ctl, {"id": "moving", "payload": str(gate)})
    driver.get(f"{ctl.url}/ui/jobs/moving")
    wait = WebDriverWait(driver, 20)
    first = wait.until(lambda d: _bar(d, "#job-head") > 0 and _bar(d, "#job-head"))
    # The page is not loaded again: its live part brings the next values.
    wait.until(lambda d: _bar(d, "#job-head") > first)
    assert "step" in driver.find_element(By.ID, "job-head").text
    driver.get(f"{ctl.url}/ui/jobs")
    wait.until(lambda d: _bar(d, "#jobs-list") > 0)
    gate.touch()
    driver.get(f"{ctl.url}/ui/jobs/moving")
    wait.until(lambda d: "finished" in d.find_element(By.ID, "job-head").text)
    assert _bar(driver, "#job-head") > 0  # an ended job keeps its last value


def test_a_batch_page_and_a_waiting_job_link_to_each_other(
    browser: tuple[LiveController, WebDriver, Path],
) -> None:
    """The batch page counts its jobs and links its then job, which waits for them and links
    back; a job waiting for another links to it."""
    ctl, driver, tmp = browser
    gate = tmp / "batch-gate"
    request = urllib.request.Request(
        f"{ctl.url}/batch/",
        json.dumps(
            {
                "jobs": [{"id": "part-1", "payload": str(gate)}],
                "then": {"id": "join", "payload": str(gate)},  # the worker waits for the file
            }
        ).encode(),
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=20) as resp:
        batch = json.loads(resp.read())
    wait = WebDriverWait(driver, 20)
    driver.get(f"{ctl.url}/ui/jobs/join")
    assert "runs after" in driver.find_element(By.CSS_SELECTOR, "p.waits").text
    assert driver.find_element(By.CSS_SELECTOR, "#job-head b").text == "waiting"
    driver.find_element(By.LINK_TEXT, batch["id"]).click()
    wait.until(lambda d: "/ui/batches/" in d.current_url)
    assert "part-1" in driver.page_source and "join" in driver.page_source
    gate.touch()
    driver.get(f"{ctl.url}/ui/jobs/join")
    wait.until(lambda d: "finished" in d.find_element(By.ID, "job-head").text)
    driver.find_element(By.LINK_TEXT, "part-1").click()
    wait.until(lambda d: d.current_url.endswith("/ui/jobs/part-1"))
