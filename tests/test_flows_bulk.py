"""Bulk submission (DESIGN.md section 17): `POST /job/` with a JSON array of jobs, on an
in-process controller with real sockets and a real journal: the answers in order, existing
ids and ids repeated in the array, the first bad job's index (and nothing made), more than
10,000 (413), the room for all of them (503), one journal commit that survives a restart;
by property on a real controller, any array of good and bad jobs makes all of them or none;
and the client's `submit_many` over http:// and udp://."""

from __future__ import annotations

import itertools
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.client import AsyncClient, Client, ControllerError
from controller.doors.http import codec
from controller.doors.http.codec import MAX_BULK
from controller.journal import Journal
from tests.helpers import REDIS_SERVER, LiveController, live_controller, redis_server
from tests.test_http import client, http_controller


async def test_an_array_answers_201_and_its_jobs_in_order(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        body = [{"id": "b-1", "payload": "one"}, {"name": "second"}, {"payload_b64": "/w=="}]
        resp = await http.post("/job/", json=body)
        assert resp.status_code == 201, resp.text
        jobs = resp.json()
        assert [job["state"] for job in jobs] == ["pending"] * 3
        assert jobs[0]["id"] == "b-1" and jobs[0]["payload"] == "one"
        assert jobs[1]["name"] == "second" and len(jobs[1]["id"]) == 36
        assert jobs[2]["payload_b64"] == "/w=="
        assert len({job["task_id"] for job in jobs}) == 3
        for job in jobs:  # each is there as the answer said
            assert (await http.get(f"/job/{job['id']}/")).json()["id"] == job["id"]
        # A single job's body is answered as before: an object, not an array of one.
        single = await http.post("/job/", json={"id": "alone"})
        assert single.status_code == 201 and single.json()["id"] == "alone"
        one = await http.post("/job/", json=[{"id": "in-array"}])
        assert one.status_code == 201 and [job["id"] for job in one.json()] == ["in-array"]


async def test_existing_ids_and_ids_repeated_in_the_array_answer_that_job(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        assert (await http.post("/job/", json={"id": "old", "payload": "first"})).status_code == 201
        body = [
            {"id": "new", "payload": "a"},
            {"id": "old", "payload": "other"},
            {"id": "new", "payload": "b"},
        ]
        resp = await http.post("/job/", json=body)
        assert resp.status_code == 201, resp.text
        new, old, again = resp.json()
        assert old["id"] == "old" and old["payload"] == "first"
        assert new == again and new["payload"] == "a"
        assert ctl.shell.core.counters.submitted == 2
        # Nothing new made: 200, as a single POST of an existing id.
        resp = await http.post("/job/", json=[{"id": "old"}, {"id": "new"}, {"id": "old"}])
        assert resp.status_code == 200, resp.text
        assert [job["id"] for job in resp.json()] == ["old", "new", "old"]
        empty = await http.post("/job/", json=[])
        assert empty.status_code == 200 and empty.json() == []
        assert ctl.shell.core.counters.submitted == 2


async def test_a_unique_key_held_in_or_before_the_array_answers_its_holder(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        held = await http.post("/job/", json={"id": "holder", "unique_key": "k-1"})
        assert held.status_code == 201
        body = [
            {"id": "a", "unique_key": "k-2"},
            {"id": "b", "unique_key": "k-1"},
            {"id": "c", "unique_key": "k-2"},
        ]
        resp = await http.post("/job/", json=body)
        assert resp.status_code == 201, resp.text
        assert [job["id"] for job in resp.json()] == ["a", "holder", "a"]
        assert ctl.shell.core.counters.submitted == 2


@pytest.mark.parametrize(
    ("body", "status", "parts"),
    [
        ([{"id": "g"}, {"id": "bad", "name": 5}], 400, ["job 1 (id 'bad')", "name must be text"]),
        ([{}, {}, 7], 400, ["job 2:", "JSON object"]),
        ([{"id": "g"}, {"colour": "red"}], 400, ["job 1:", "unknown field 'colour'"]),
        ([{"id": "g"}, {"id": "udp-x-1-2"}], 400, ["job 1 (id 'udp-x-1-2')"]),
        ([{"id": 5}], 400, ["job 0:", "id must be text"]),
        ([{"priority": 1000}, {"name": 1}], 400, ["job 0:", "priority"]),
        ([{"id": "g"}, {"payload": "x" * 2000}], 413, ["job 1:", "max_extra_size"]),
    ],
)
async def test_a_bad_job_names_its_index_and_nothing_is_made(sockdir, body, status, parts):
    async with (
        http_controller(sockdir, workers=0, max_extra_size=1000) as ctl,
        client(ctl.url) as http,
    ):
        resp = await http.post("/job/", json=body)
        assert resp.status_code == status, resp.text
        error = resp.json()
        assert error["code"] == status
        for part in parts:
            assert part in error["message"]
        assert ctl.shell.core.counters.submitted == 0 and ctl.desk.book.get("g") is None


@pytest.mark.parametrize(
    "raw",
    [b"[", b"[{}", b"[{},]", b"[{}}", b"[{} {}]", b"[{}] x", b"[,{}]", b"[" * 100_000],
)
async def test_a_malformed_array_is_400_and_the_next_good_one_is_taken(sockdir, raw):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        resp = await http.post("/job/", content=raw)
        assert resp.status_code == 400 and "not valid JSON" in resp.json()["message"]
        assert ctl.shell.core.counters.submitted == 0
        resp = await http.post("/job/", content=b" [ {} , {} ] ")
        assert resp.status_code == 201 and len(resp.json()) == 2


async def test_10000_small_jobs_fit_and_more_is_413(sockdir):
    # With max_extra_size 1000 a single job's body may have about 66 KB; an array's has
    # 1 KiB a job more, so 10,000 jobs of 80 bytes (about 1 MB) fit.
    async with (
        http_controller(sockdir, workers=0, max_extra_size=1000) as ctl,
        client(ctl.url) as http,
    ):
        jobs = [{"payload": f"{n:080d}"} for n in range(MAX_BULK + 1)]
        resp = await http.post("/job/", json=jobs)
        assert resp.status_code == 413 and "more than 10000 jobs" in resp.json()["message"]
        assert ctl.shell.core.counters.submitted == 0
        resp = await http.post("/job/", json=jobs[:MAX_BULK])
        assert resp.status_code == 201, resp.text[:300]
        answered = resp.json()
        assert [job["payload"] for job in answered] == [job["payload"] for job in jobs[:-1]]
        assert ctl.desk.live_jobs == MAX_BULK
        # A single job's body keeps its own limit.
        resp = await http.post("/job/", content=b'{"name": "' + b"n" * 100_000 + b'"}')
        assert resp.status_code == 413 and "body is over" in resp.json()["message"]


async def test_the_room_is_checked_for_the_whole_array_before_any_is_made(sockdir, tmp_path):
    limits = {"max_pending": 3, "max_pending_bytes": 1000}
    journal = tmp_path / "j.sqlite3"
    async with (
        http_controller(sockdir, workers=0, journal=journal, **limits) as ctl,
        client(ctl.url) as http,
    ):
        assert (await http.post("/job/", json={"id": "there"})).status_code == 201
        resp = await http.post("/job/", json=[{"id": "a"}, {"id": "b"}, {"id": "c"}])
        assert resp.status_code == 503 and "max_pending is 3" in resp.json()["message"]
        assert int(resp.headers["retry-after"]) >= 1
        assert ctl.desk.book.get("a") is None and ctl.desk.live_jobs == 1
        big = [{"id": "d", "payload": "x" * 500}, {"id": "e", "payload": "y" * 501}]
        resp = await http.post("/job/", json=big)
        assert resp.status_code == 503 and "max_pending_bytes" in resp.json()["message"]
        assert ctl.desk.book.get("d") is None
        # An existing id and a repeated one take no room: two new jobs fit.
        body = [{"id": "there"}, {"id": "a"}, {"id": "a"}, {"id": "b"}]
        assert (await http.post("/job/", json=body)).status_code == 201
        assert ctl.desk.live_jobs == 3
        assert ctl.desk.journal is not None
        ctl.desk.journal.failing = "disk full (simulated)"
        resp = await http.post("/job/", json=[{"id": "there"}, {"id": "z"}])
        assert resp.status_code == 503 and "disk full" in resp.json()["message"]
        assert "retry-after" in resp.headers
        assert ctl.desk.book.get("z") is None
        ctl.desk.journal.failing = ""


async def test_an_array_is_journaled_in_one_commit_and_survives_a_restart(sockdir, tmp_path):
    path = tmp_path / "j.sqlite3"
    ids = [f"kept-{n}" for n in range(200)]
    async with http_controller(sockdir, workers=0, journal=path) as ctl, client(ctl.url) as http:
        journal = ctl.desk.journal
        assert journal is not None
        before = journal.committed
        body = [{"id": job_id, "payload": job_id, "name": "bulk"} for job_id in ids]
        resp = await http.post("/job/", json=body)
        assert resp.status_code == 201
        assert journal.committed == before + 1  # one commit for the whole array
        rows = Journal.open(path).load().jobs  # a second reader sees them all committed
        assert sorted(row.id for row in rows) == sorted(ids)
    async with http_controller(sockdir, workers=1, journal=path) as ctl, client(ctl.url) as http:
        for job_id in ids:
            done = (await http.get(f"/job/{job_id}/", params={"wait": 10})).json()
            assert done["state"] == "finished" and done["result"] == job_id
            assert done["name"] == "bulk"


# ---------------------------------------------------------------- by property, on a live controller


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveController]:
    tmp = tmp_path_factory.mktemp("bulk")
    with live_controller(tmp, "--workers", "1", max_extra_size=100) as ctl:
        yield ctl


def _post(url: str, body: Any) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"{url}/job/", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _exists(url: str, job_id: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/job/{job_id}/", timeout=30):
            return True
    except urllib.error.HTTPError as exc:
        assert exc.code == 404
        return False


_GOOD = st.fixed_dictionaries(
    {}, optional={"payload": st.text(max_size=20), "name": st.text(max_size=10)}
)
_BAD = st.one_of(
    st.integers(),
    st.none(),
    st.just({"payload": "p" * 101}),  # over max_extra_size
    st.just({"name": 3}),
    st.just({"unknown": "x"}),
    st.just({"priority": "high"}),
    st.just({"id": "udp-1-2-3"}),
)
_SERIAL = itertools.count()


def _good(element: Any) -> bool:
    """Whether `element` is one of _GOOD's (a payload and a name, both text, the payload
    within the max_extra_size of 100 the tests give)."""
    return (
        isinstance(element, dict)
        and set(element) <= {"payload", "name"}
        and all(isinstance(value, str) for value in element.values())
        and len(element.get("payload", "").encode("utf-8", "surrogatepass")) <= 100
    )


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.tuples(st.booleans(), _GOOD, _BAD), max_size=12))
def test_any_array_of_good_and_bad_jobs_makes_all_or_none(live, elements):
    body, ids = [], []
    for good, job, bad in elements:
        job_id = f"h{next(_SERIAL)}"
        ids.append(job_id)
        body.append({**job, "id": job_id} if good else bad)
    status, answer = _post(live.url, body)
    if all(good for good, _, _ in elements):
        assert status == (201 if body else 200), answer
        assert [job["id"] for job in answer] == ids
        assert all(_exists(live.url, job_id) for job_id in ids)
    else:
        first = next(n for n, (good, _, _) in enumerate(elements) if not good)
        assert status in (400, 413) and answer["message"].startswith(f"job {first}"), answer
        assert not any(_exists(live.url, job_id) for job_id in ids)


# ---------------------------------------------------------------- the client's submit_many


def test_submit_many_over_http_one_request_in_order(live):
    with Client(live.url) as client:
        jobs = client.submit_many([b"raw", "text", {"payload": "opts", "name": "n", "priority": 5}])
        assert [job.result(timeout=10) for job in jobs] == [b"raw", b"text", b"opts"]
        assert jobs[2].info["name"] == "n" and jobs[2].info["priority"] == 5
        again = client.submit_many([{"id": jobs[0].id, "payload": "other"}])
        assert again[0].id == jobs[0].id and again[0].result(timeout=10) == b"raw"
        with pytest.raises(ControllerError) as refused:
            client.submit_many([b"fine", b"x" * 101])
        assert refused.value.status == 413 and "job 1" in str(refused.value)
        with pytest.raises(ValueError):  # checked before anything is sent
            client.submit_many([{"priority": 1000}])
        with pytest.raises(TypeError):
            client.submit_many([{"colour": "red"}])
        assert client.submit_many([]) == []


def test_submit_many_over_udp_one_submission_each(live):
    with Client(f"udp://127.0.0.1:{live.udp_port}") as client:
        jobs = client.submit_many([b"u1", {"payload": "u2", "queue": "default"}])
        assert [job.result(timeout=10) for job in jobs] == [b"u1", b"u2"]
        assert all(job.id.startswith("udp-") for job in jobs)
        with pytest.raises(ValueError, match="id is not accepted"):
            client.submit_many([b"u3", {"id": "named"}])


async def test_async_submit_many_over_http_and_udp(live):
    for url in (live.url, f"udp://127.0.0.1:{live.udp_port}"):
        async with AsyncClient(url) as client:
            jobs = await client.submit_many([b"a1", {"payload": "a2"}])
            assert [await job.result(timeout=10) for job in jobs] == [b"a1", b"a2"]
            await trio.lowlevel.checkpoint()


def test_submit_many_splits_past_10000(live, monkeypatch):
    from controller.client import job_calls

    monkeypatch.setattr(job_calls, "MAX_BULK", 2)
    with Client(live.url) as client:
        jobs = client.submit_many([f"s{n}" for n in range(5)])
        assert [job.result(timeout=10) for job in jobs] == [f"s{n}".encode() for n in range(5)]


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
def test_submit_many_over_redis_in_one_pipeline(tmp_path):
    with (
        redis_server(tmp_path) as server,
        live_controller(tmp_path, "--workers", "1", redis={"url": server.url}) as ctl,
        Client(server.url) as client,
    ):
        assert ctl.url
        jobs = client.submit_many([b"r1", {"payload": "r2", "id": "named-r"}, "r3"])
        assert jobs[1].id == "named-r"
        assert [job.result(timeout=20) for job in jobs] == [b"r1", b"r2", b"r3"]
        with pytest.raises(ValueError):  # a bad id: nothing is sent
            client.submit_many([b"not sent", {"id": "a/b"}])
        raw = redis.Redis.from_url(server.url)
        assert raw.xlen("jobs") == 3
        raw.close()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.booleans())
def test_any_bytes_after_a_bracket_parse_or_raise_the_apis_error(raw, bracket):
    body = (b"[" if bracket else b"") + raw
    try:
        news, many = codec.parse_new_jobs(body, 1000)
    except codec.ApiError as exc:
        assert exc.status in (400, 413) and exc.message
    else:
        assert many or len(news) == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(_GOOD, _BAD), max_size=20))
def test_the_codec_reads_every_element_or_names_the_first_bad_one(elements):
    body = json.dumps(elements).encode()
    bad = [n for n, element in enumerate(elements) if not _good(element)]
    try:
        news, many = codec.parse_new_jobs(body, 100)
    except codec.ApiError as exc:
        assert bad and exc.message.startswith(f"job {bad[0]}")
    else:
        assert many and not bad and len(news) == len(elements)
