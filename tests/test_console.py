"""The operator's console over HTTP: every page and action, sessions, CSRF, escaping, bulk."""

from __future__ import annotations

import re

import httpx
import trio

from controller.doors.http import access
from controller.doors.http.access import BLOCK_SECONDS, Strikes
from controller.doors.http.console.handlers import page_of
from controller.doors.http.console.session import Sessions, TokenFile, parse_cookies
from controller.doors.http.console.stats import SPAN_SECONDS, EndRate
from controller.job_states import JobState
from tests.helpers import wait_until
from tests.test_http import client, http_controller

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def csrf_of(page: httpx.Response) -> str:
    found = CSRF.search(page.text)
    assert found is not None, page.text[:2000]
    return found.group(1)


def section(page: httpx.Response, ident: str) -> str:
    start = page.text.index(f"id={ident}")
    return page.text[start : page.text.index("</section>", start)]


async def login(http: httpx.AsyncClient, token: str) -> httpx.Response:
    form = await http.get("/ui/login")
    assert form.status_code == 200 and 'name="token"' in form.text
    return await http.post("/ui/login", data={"csrf": csrf_of(form), "token": token})


# ---------------------------------------------------------------- pure parts


def test_end_rate_counts_per_second_and_forgets_after_ten_minutes():
    rate = EndRate()
    rate.record(1000.2, failed=False)
    rate.record(1000.7, failed=False)
    rate.record(1001.0, failed=True)
    finished, failed = rate.series(1001.5)
    assert len(finished) == SPAN_SECONDS and (finished[-2], finished[-1]) == (2, 0)
    assert (failed[-2], failed[-1]) == (0, 1)
    assert rate.per_minute(1001.5)[0] == (0, 2, 1)
    rate.record(1000.0 + SPAN_SECONDS, failed=False)  # the same slot, ten minutes on
    finished, failed = rate.series(1000.0 + SPAN_SECONDS)
    assert sum(finished) == 1 and sum(failed) == 1 and finished[-1] == 1
    assert rate.as_json(1000.0 + SPAN_SECONDS, 5.0)["end"] == 1005 + SPAN_SECONDS


def test_cookie_flags_and_secure_over_tls(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("t1\n")
    plain = Sessions(TokenFile(tokens), secure=False)
    name, value = plain.browser_cookie("b1")
    text = value.decode()
    assert name == b"set-cookie" and "HttpOnly" in text and "SameSite=Strict" in text
    assert "Path=/" in text and "Secure" not in text
    tls = Sessions(TokenFile(tokens), secure=True)
    (_, session), *_ = tls.session_cookies("b1", "hash")
    assert session.decode().endswith("; Secure") and "Max-Age=43200" in session.decode()
    assert "t1" not in session.decode()  # a hash of the token, never the token
    assert parse_cookies('a=1; b="2"; a=3') == {"a": "1", "b": "2"}


# ---------------------------------------------------------------- pages, without a token file


async def test_overview_shows_workers_queues_counters_chart_and_latest_jobs(sockdir):
    async with (
        http_controller(
            sockdir, workers=1, handler="tests.worker_handlers:bad_payload", max_retries=0
        ) as ctl,
        client(ctl.url) as http,
    ):
        await http.post("/job/", json={"id": "good", "payload": "ok", "name": "shown"})
        await http.post("/job/", json={"id": "bad", "payload": "bad"})
        for job_id in ("good", "bad"):
            await http.get(f"/job/{job_id}/", params={"wait": 10})
        page = await http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        for words in ("Workers", "local", "queue depth", "Latest jobs", "Counters", "Queues"):
            assert words in page.text, words
        assert "<canvas id=rate" in page.text and 'data-source="/ui/stats"' in page.text
        assert '<a href="/ui/jobs/good">good</a>' in page.text
        table = page.text[page.text.index("id=rate-table") :]
        assert "<tr><td>this minute</td><td class=num>1</td><td class=num>1</td></tr>" in table
        stats = (await http.get("/ui/stats")).json()
        assert len(stats["finished"]) == len(stats["failed"]) == stats["seconds"] == 600
        assert (sum(stats["finished"]), sum(stats["failed"])) == (1, 1)
        assert abs(stats["end"] - trio.current_time() - ctl.desk.book.wall_offset) < 5
        css = await http.get("/ui/static/console.css")
        assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
        js = await http.get("/ui/static/console.js")
        assert "getContext" in js.text and "text/javascript" in js.headers["content-type"]
        missing = await http.get("/ui/static/nothing.js")
        assert missing.status_code == 404 and missing.json()["message"]


async def test_jobs_list_filters_searches_and_pages_newest_first(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        for n in range(120):
            body = {"id": f"job-{n:03d}", "name": f"name-{n % 3}", "queue": "q1"}
            await http.post("/job/", json=body)
        await http.post("/job/", json={"id": "other", "queue": "q2"})
        first = await http.get("/ui/jobs", params={"state": "pending", "queue": "q1"})
        listed = re.findall(r'<a href="/ui/jobs/(job-\d+)">', section(first, "jobs-list"))
        assert listed == [f"job-{n:03d}" for n in range(119, 69, -1)]  # 50, newest first
        assert 'rel=next href="/ui/jobs?state=pending&amp;queue=q1&amp;page=1"' in first.text
        assert "rel=prev" not in first.text
        assert '<option value="q1" selected>q1</option>' in first.text
        last = await http.get("/ui/jobs", params={"queue": "q1", "page": 2})
        listed = re.findall(r'<a href="/ui/jobs/(job-\d+)">', section(last, "jobs-list"))
        assert listed == [f"job-{n:03d}" for n in range(19, -1, -1)]
        assert "rel=next" not in last.text and "rel=prev" in last.text
        found = await http.get("/ui/jobs", params={"q": "NAME-1"})  # a name, case aside
        listed = re.findall(r'<a href="/ui/jobs/(job-\d+)">', section(found, "jobs-list"))
        assert len(listed) == 40 and all(int(i[4:]) % 3 == 1 for i in listed)
        by_id = await http.get("/ui/jobs", params={"q": "job-007"})
        assert re.findall(r'<a href="/ui/jobs/(job-\d+)">', by_id.text) == ["job-007"]
        assert "other" not in section(first, "jobs-list")
        assert "no job matches" in (await http.get("/ui/jobs?state=failed")).text
        bad = await http.get("/ui/jobs", params={"state": "bogus"})
        assert bad.status_code == 400 and "unknown state" in bad.text
        assert (await http.get("/ui/jobs", params={"queue": "Bad Name"})).status_code == 400


async def test_job_page_shows_every_field_payload_result_attempts_and_output(sockdir, tmp_path):
    journal = tmp_path / "j.sqlite3"  # attempts are kept where a journal is
    async with (
        http_controller(
            sockdir, 1, "tests.worker_handlers:cannot_do", journal, max_retries=1
        ) as ctl,
        client(ctl.url) as http,
    ):
        await http.post(
            "/job/", json={"id": "bin", "payload_b64": "/wABAg==", "name": "n", "priority": 5}
        )
        await http.get("/job/bin/", params={"wait": 10})
        page = await http.get("/ui/jobs/bin")
        assert page.status_code == 200
        fields = section(page, "job-fields")
        for name in ("task_id", "door", "queue", "priority", "requires", "max_retries", "owner"):
            assert f"<th>{name}</th>" in fields, name
        assert "<th>priority</th><td>5</td>" in fields
        assert "4 bytes, not UTF-8 text" in page.text and "<pre>ff 00 01 02</pre>" in page.text
        attempts = section(page, "job-attempts")
        assert attempts.count("<td class=failed>failed</td>") == 2  # max_retries 1: two tries
        assert "cannot do" in attempts
        assert '<iframe src="/job/bin/output"' in page.text
        assert 'data-follow="/job/bin/output?follow=1"' in page.text
        actions = section(page, "job-head")
        assert (
            'action="/ui/jobs/bin/retry"' in actions and 'action="/ui/jobs/bin/delete"' in actions
        )
        assert "/cancel" not in actions  # not live
        assert (await http.get("/ui/jobs/nobody")).status_code == 404


async def test_finished_job_shows_its_text_result(sockdir):
    async with http_controller(sockdir, workers=1) as ctl, client(ctl.url) as http:
        await http.post("/job/", json={"id": "t", "payload": "héllo"})
        await http.get("/job/t/", params={"wait": 10})
        page = await http.get("/ui/jobs/t")
        assert section(page, "job-result").count("<pre>héllo</pre>") == 1
        assert "/retry" not in section(page, "job-head")


async def test_cancel_retry_delete_and_pause_from_forms(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        await http.post("/job/", json={"id": "c"})
        page = await http.get("/ui/jobs/c")
        csrf = csrf_of(page)
        assert 'action="/ui/jobs/c/cancel"' in page.text
        book = ctl.desk.book
        done = await http.post("/ui/jobs/c/cancel", data={"csrf": csrf})
        assert done.status_code == 303 and done.headers["location"] == "/ui/jobs/c"
        assert book.get("c").state is JobState.CANCELED
        assert (await http.post("/ui/jobs/c/retry", data={"csrf": csrf})).status_code == 303
        assert book.get("c").state is JobState.PENDING
        assert (await http.post("/ui/jobs/c/delete", data={"csrf": csrf})).status_code == 303
        assert book.get("c").state is JobState.DELETED
        again = await http.post("/ui/jobs/c/retry", data={"csrf": csrf})
        assert again.status_code == 409 and "only a failed or canceled job" in again.text
        assert (await http.post("/ui/jobs/none/cancel", data={"csrf": csrf})).status_code == 404
        await http.post("/job/", json={"id": "waits"})
        queues = await http.get("/ui/queues")
        assert (
            ">Pause</button>" in queues.text and '<a href="/ui/jobs?queue=default">' in queues.text
        )
        paused = await http.post("/ui/queues/default", data={"csrf": csrf, "paused": "1"})
        assert paused.status_code == 303 and paused.headers["location"] == "/ui/queues"
        assert "default" in ctl.shell.core.scheduler.pending.paused
        assert ">Resume</button>" in (await http.get("/ui/queues")).text
        await http.post("/ui/queues/default", data={"csrf": csrf, "paused": "0"})
        assert "default" not in ctl.shell.core.scheduler.pending.paused
        bad = await http.post("/ui/queues/Bad%20Name", data={"csrf": csrf, "paused": "1"})
        assert bad.status_code == 400
        named = {"csrf": csrf, "name": "later", "paused": "1"}  # a queue not listed yet
        assert (await http.post("/ui/queues", data=named)).status_code == 303
        assert "later" in ctl.shell.core.scheduler.pending.paused
        assert 'action="/ui/queues/later"' in (await http.get("/ui/queues")).text


async def test_workers_page_shows_kind_queues_labels_state_job_pulse_and_done(sockdir):
    slow = "tests.worker_handlers:sleeps_a_minute"
    async with http_controller(sockdir, workers=1, handler=slow) as ctl, client(ctl.url) as http:
        await http.post("/job/", json={"id": "held"})
        await wait_until(lambda: ctl.desk.book.get("held").state is JobState.WORKING)
        page = await http.get("/ui/workers")
        rows = section(page, "workers")
        for header in ("kind", "queues", "labels", "state", "job", "last pulse", "done"):
            assert f"<th>{header}</th>" in rows
        assert "<td>local</td>" in rows and '<a href="/ui/jobs/held">held</a>' in rows
        assert "<td>default</td>" in rows and " ago</td>" in rows


async def test_a_post_without_the_right_csrf_token_is_403(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        await http.post("/job/", json={"id": "x"})
        csrf = csrf_of(await http.get("/ui/jobs/x"))
        off_by_one = csrf[:-1] + ("1" if csrf[-1] != "1" else "2")
        for form in ({}, {"csrf": "wrong"}, {"csrf": off_by_one}):
            refused = await http.post("/ui/jobs/x/cancel", data=form)
            assert refused.status_code == 403 and "CSRF" in refused.text
        async with client(ctl.url) as stranger:  # another browser: its own token
            refused = await stranger.post("/ui/jobs/x/cancel", data={"csrf": csrf})
            assert refused.status_code == 403
            other = csrf_of(await stranger.get("/ui/jobs/x"))
            assert other != csrf
        bulk = await http.post("/ui/bulk", data={"state": "failed", "action": "delete"})
        assert bulk.status_code == 403
        assert ctl.desk.book.get("x").state is JobState.PENDING


async def test_names_and_payloads_are_escaped_everywhere(sockdir):
    evil = "<script>alert(1)</script>"
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        body = {"id": "evil", "name": evil, "payload": "<b>markup</b> & more"}
        assert (await http.post("/job/", json=body)).status_code == 201
        for path in ("/", "/ui/jobs", "/ui/jobs/evil", "/ui/jobs?q=%3Cscript"):
            text = (await http.get(path)).text
            assert "<script>alert" not in text and "<b>markup" not in text, path
            assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text, path
        page = (await http.get("/ui/jobs/evil")).text
        assert "&lt;b&gt;markup&lt;/b&gt; &amp; more" in page
        searched = (await http.get("/ui/jobs", params={"q": '"><script>'})).text
        assert 'value="&quot;&gt;&lt;script&gt;"' in searched


async def test_bulk_retry_and_delete_of_failed_jobs_show_the_count_first(sockdir):
    flaky = "tests.worker_handlers:fails_until_passed"
    async with (
        http_controller(sockdir, workers=1, handler=flaky, max_retries=0) as ctl,
        client(ctl.url) as http,
    ):
        for n in range(12):
            await http.post("/job/", json={"id": f"f{n}", "name": "drop" if n < 5 else "keep"})
        book = ctl.desk.book
        await wait_until(lambda: book.count(JobState.FAILED) == 12)
        listing = await http.get("/ui/jobs", params={"state": "failed", "q": "drop"})
        assert "Delete all…" in listing.text and "Retry all…" in listing.text
        csrf = csrf_of(listing)
        form = {"csrf": csrf, "state": "failed", "queue": "", "q": "drop", "action": "delete"}
        asked = await http.post("/ui/bulk", data=form)
        assert asked.status_code == 200 and "5 failed jobs match this filter" in asked.text
        assert book.count(JobState.FAILED) == 12  # nothing done yet
        done = await http.post("/ui/bulk", data={**form, "confirm": "1"})
        assert done.status_code == 200 and "5 jobs deleted" in done.text
        assert book.count(JobState.DELETED) == 5 and book.count(JobState.FAILED) == 7
        (ctl.noted.parent / "passed").touch()
        form = {**form, "q": "", "action": "retry"}
        assert "7 failed jobs match" in (await http.post("/ui/bulk", data=form)).text
        done = await http.post("/ui/bulk", data={**form, "confirm": "1"})
        assert "7 jobs retried" in done.text
        await wait_until(lambda: book.count(JobState.FINISHED) == 7)
        assert book.count(JobState.DELETED) == 5
        wrong = await http.post("/ui/bulk", data={**form, "state": "pending"})
        assert wrong.status_code == 400
        no_list = await http.get("/ui/jobs", params={"state": "pending"})
        assert "Retry all" not in no_list.text


# ---------------------------------------------------------------- with a token file


async def test_login_goes_back_to_the_page_asked_for_and_nowhere_else(sockdir, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("t\n")
    async with (
        http_controller(sockdir, workers=0, http_token_file=tokens) as ctl,
        client(ctl.url) as http,
    ):
        asked = await http.get("/ui/jobs", params={"state": "failed", "q": "a b"})
        assert asked.status_code == 401 and asked.headers["www-authenticate"] == "Bearer"
        then = re.search(r'name="then" value="([^"]+)"', asked.text)
        assert then is not None and then.group(1) == "/ui/jobs?state=failed&amp;q=a+b"
        csrf = csrf_of(asked)
        done = await http.post(
            "/ui/login", data={"csrf": csrf, "token": "t", "then": "/ui/jobs?state=failed"}
        )
        assert done.status_code == 303 and done.headers["location"] == "/ui/jobs?state=failed"
        for elsewhere in ("//evil.example/", "https://evil.example/", "/job/", "/ui/login"):
            form = {"csrf": csrf, "token": "t", "then": elsewhere}
            assert (await http.post("/ui/login", data=form)).headers["location"] == "/"
        form = {"csrf": csrf, "token": "t", "then": "/ui/jobs/a\r\nX: y"}
        assert (await http.post("/ui/login", data=form)).headers[
            "location"
        ] == "/ui/jobs/a%0D%0AX%3A%20y"


async def test_login_session_cookie_logout_and_token_removal(sockdir, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("# operators\nsecret-one\nsecret-two\n")
    async with (
        http_controller(sockdir, workers=0, http_token_file=tokens) as ctl,
        client(ctl.url) as http,
    ):
        await http.post("/job/", json={"id": "j"}, headers={"Authorization": "Bearer secret-one"})
        for path in ("/", "/ui/jobs", "/ui/jobs/j", "/ui/stats", "/ui/queues", "/ui/workers"):
            refused = await http.get(path)
            assert refused.status_code == 401, path
            assert 'action="/ui/login"' in refused.text and 'name="token"' in refused.text
        assert (await http.post("/ui/jobs/j/cancel", data={})).status_code == 401
        wrong = await login(http, "secret-three")
        assert wrong.status_code == 401 and "not in the token file" in wrong.text
        good = await login(http, "secret-two")
        assert good.status_code == 303 and good.headers["location"] == "/"
        asked = await http.get("/ui/jobs", params={"state": "failed"})  # logged in now
        assert asked.status_code == 200
        cookie = good.headers["set-cookie"]
        for flag in ("console_session=", "HttpOnly", "SameSite=Strict", "Path=/", "Max-Age=43200"):
            assert flag in cookie, flag
        assert "Secure" not in cookie and "secret-two" not in cookie
        page = await http.get("/")
        assert page.status_code == 200 and "Log out" in page.text
        assert (await http.get("/ui/jobs/j")).status_code == 200
        # The API takes bearer tokens only; the session opens a job's output, nothing else.
        assert (await http.get("/job/")).status_code == 401
        assert (await http.get("/job/j/output")).status_code != 401
        assert (await http.put("/job/j/", json={"state": "canceled"})).status_code == 401
        async with client(ctl.url) as stranger:
            assert (await stranger.get("/job/j/output")).status_code == 401
        # Another browser with the same cookie but not its browser id: no session.
        async with client(
            ctl.url, cookies={"console_session": http.cookies["console_session"]}
        ) as copied:
            assert (await copied.get("/")).status_code == 401
        csrf = csrf_of(page)
        out = await http.post("/ui/logout", data={"csrf": csrf})
        assert out.status_code == 303 and out.headers["location"] == "/ui/login"
        assert (await http.get("/")).status_code == 401
        assert (await login(http, "secret-one")).status_code == 303
        stale = await http.post("/ui/jobs/j/cancel", data={"csrf": csrf})  # from before
        assert stale.status_code == 403
        tokens.write_text("secret-two\n")  # secret-one leaves the file: its session ends

        async def until_refused() -> None:
            while (await http.get("/")).status_code != 401:
                await trio.sleep(0.05)

        with trio.fail_after(10):
            await until_refused()
        assert (await login(http, "secret-two")).status_code == 303
        assert (await http.get("/")).status_code == 200


async def test_a_bearer_token_opens_every_page_but_no_form(sockdir, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("secret\n")
    bearer = {"Authorization": "Bearer secret"}
    async with (
        http_controller(sockdir, workers=0, http_token_file=tokens) as ctl,
        client(ctl.url) as http,
    ):
        await http.post("/job/", json={"id": "j"}, headers=bearer)
        for path in (
            "/",
            "/ui",
            "/ui/jobs",
            "/ui/jobs/j",
            "/ui/stats",
            "/ui/queues",
            "/ui/workers",
        ):
            page = await http.get(path, headers=bearer)
            assert page.status_code == 200, path
            assert 'name="token"' not in page.text, path
        assert (await http.get("/", headers={"Authorization": "Bearer wrong"})).status_code == 401
        # its forms still need the console's session
        form = {"csrf": csrf_of(await http.get("/ui/jobs/j", headers=bearer))}
        refused = await http.post("/ui/jobs/j/cancel", data=form, headers=bearer)
        assert refused.status_code == 401 and 'name="token"' in refused.text
        assert ctl.desk.book.get("j").state is JobState.PENDING
        # the login page is an ordinary page: 200, the form, no challenge
        login_page = await http.get("/ui/login")
        assert login_page.status_code == 200 and 'name="token"' in login_page.text
        assert "www-authenticate" not in login_page.headers


def test_strikes_block_an_address_after_ten_within_a_minute(monkeypatch):
    strikes = Strikes()
    for n in range(9):
        strikes.strike("a", 100.0 + n)
    assert strikes.until("a", 108.0) == 0.0
    strikes.strike("a", 159.9)  # the tenth within a minute of the first
    assert strikes.until("a", 160.0) == 159.9 + BLOCK_SECONDS
    assert strikes.until("b", 160.0) == 0.0  # another address is not concerned
    assert strikes.until("a", 159.9 + BLOCK_SECONDS) == 0.0 and not strikes.blocked
    for n in range(10):  # ten spread over more than a minute: no block
        strikes.strike("c", 1000.0 + 7 * n)
    assert strikes.until("c", 1064.0) == 0.0
    monkeypatch.setattr(access, "MAX_ADDRESSES", 3)
    for n in range(10):  # many addresses: the least recently struck are forgotten
        strikes.strike(f"x{n}", 2000.0)
    assert len(strikes._recent) == 3


async def test_ten_wrong_tokens_from_one_address_get_429_for_a_minute(sockdir, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("secret\n")
    good = {"Authorization": "Bearer secret"}
    async with (
        http_controller(sockdir, workers=0, http_token_file=tokens) as ctl,
        client(ctl.url) as http,
    ):
        for _ in range(15):  # no token: refused, but not counted
            assert (await http.get("/job/")).status_code == 401
        # a non-ASCII token is a wrong one: 401, never 500
        odd = await http.get("/job/", headers={"Authorization": "Bearer s\xe9cret".encode()})
        assert odd.status_code == 401 and odd.json()["message"]
        for n in range(5):
            wrong = {"Authorization": f"Bearer guess-{n}"}
            assert (await http.get("/job/", headers=wrong)).status_code == 401
        for n in range(3):  # wrong console logins count as well
            form = await http.get("/ui/login")
            tried = await http.post(
                "/ui/login", data={"csrf": csrf_of(form), "token": f"guess-{n}"}
            )
            assert tried.status_code == 401
        # the tenth (one non-ASCII, five bearer, three logins before it)
        assert (await http.get("/", headers={"Authorization": "Bearer x"})).status_code == 401
        for method, path in (("GET", "/job/"), ("GET", "/"), ("GET", "/ui/login")):
            refused = await http.request(method, path, headers=good)
            assert refused.status_code == 429, path
            body = refused.json()
            assert body["code"] == 429 and body["message"] and refused.headers["retry-after"]
        assert (await http.get("/health/")).status_code == 200
        # another address is served as before
        transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        async with client(ctl.url, transport=transport) as other:
            assert (await other.get("/job/", headers=good)).status_code == 200
        # a minute later the address is served again
        gate = ctl.web.gate
        gate.clock = lambda: trio.current_time() + BLOCK_SECONDS
        assert (await http.get("/job/", headers=good)).status_code == 200


async def test_the_queue_filter_offers_every_queue_a_kept_job_names(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        for n, queue in enumerate(("q2", "q3")):
            await http.post("/job/", json={"id": f"j{n}", "queue": queue})
            await http.put(f"/job/j{n}/", json={"state": "canceled"})  # no live job in it
            page = await http.get("/ui/jobs")
            for named in ("q2", "q3")[: n + 1]:
                assert f'<option value="{named}">{named}</option>' in page.text, named
        assert "q3" not in ctl.desk.book.get("j0").options.queue


def test_a_page_past_the_last_is_the_last_in_one_pass():
    taken = []

    def jobs(count: int):
        for n in range(count):
            taken.append(n)
            yield n

    assert page_of(jobs(120), 100_000, 50) == ([100 + n for n in range(20)], 2, False)
    assert len(taken) == 120  # not a step further than the jobs there are
    assert page_of(jobs(100), 7, 50) == ([50 + n for n in range(50)], 1, False)
    assert page_of(jobs(0), 3, 50) == ([], 0, False)
    assert page_of(jobs(101), 1, 50) == ([50 + n for n in range(50)], 1, True)
    assert page_of(jobs(100), 1, 50) == ([50 + n for n in range(50)], 1, False)


async def test_a_jobs_page_far_past_the_end_shows_the_last_page(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        for n in range(60):
            await http.post("/job/", json={"id": f"job-{n:03d}", "queue": "q1"})
        far = await http.get("/ui/jobs", params={"page": 100_000})
        assert far.status_code == 200
        listed = re.findall(r'<a href="/ui/jobs/(job-\d+)">', section(far, "jobs-list"))
        assert listed == [f"job-{n:03d}" for n in range(9, -1, -1)]
        assert "rel=next" not in far.text and "rel=prev" in far.text  # page 1, the last
        none = await http.get("/ui/jobs", params={"page": 100_000, "state": "failed"})
        assert none.status_code == 200 and "no job matches" in none.text
        assert ctl.desk.book.get("job-000") is not None
