"""The Python client (controller.client) against a live controller: http:// and udp://,
blocking and async (asyncio and trio), results, failures, timeouts, cancel, threads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from controller.client import AsyncClient, Client, ClientError, ControllerError, JobFailed
from tests.helpers import LiveController, live_controller


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveController]:
    # The echo worker: the result is the payload. A job whose payload starts with
    # "sleep" is held by a worker for 30 s (a slow job to cancel).
    tmp: Path = tmp_path_factory.mktemp("lib")
    script = tmp / "job.sh"
    script.write_text(
        '#!/bin/sh\ninput=$(cat)\ncase "$input" in sleep*) sleep 30;; fail*) echo "it failed" >&2;'
        ' exit 3;; esac\nprintf %s "$input"\n'
    )
    script.chmod(0o755)
    with live_controller(tmp, "--workers", "2", "--", "--exec", str(script), max_retries=0) as ctl:
        yield ctl


def urls(live: LiveController) -> list[str]:
    return [live.url, f"udp://127.0.0.1:{live.udp_port}"]


@pytest.mark.parametrize("scheme", ["http", "udp"])
def test_submit_and_result_blocking(live, scheme):
    url = live.url if scheme == "http" else f"udp://127.0.0.1:{live.udp_port}"
    with Client(url) as client:
        job = client.submit("hello")
        assert job.result(timeout=20) == b"hello"
        assert job.state == "finished"
        binary = client.submit(b"\xff\xfe\x80")  # sh drops NUL bytes
        assert binary.result(timeout=20) == b"\xff\xfe\x80"
        if scheme == "udp":
            assert job.id.startswith("udp-127.0.0.1-")
            with pytest.raises(ValueError, match="id is not accepted"):
                client.submit("x", id="mine")
            with pytest.raises(ValueError, match="need http://"):
                client.get(job.id)


@pytest.mark.parametrize("scheme", ["http", "udp"])
def test_failed_job_raises_job_failed_with_the_workers_message(live, scheme):
    url = live.url if scheme == "http" else f"udp://127.0.0.1:{live.udp_port}"
    with Client(url) as client:
        job = client.submit("fail please")
        with pytest.raises(JobFailed) as info:
            job.result(timeout=20)
        assert "it failed" in info.value.error and info.value.state == "failed"
        assert job.state == "failed"


def test_timeout_raises_builtin_timeout_error_and_cancel_makes_it_fail(live):
    with Client(live.url) as client:
        job = client.submit("sleep a while", name="slow", id="lib-slow")
        with pytest.raises(TimeoutError):
            job.result(timeout=0.3)
        assert client.get("lib-slow").state in {"pending", "requested", "working"}
        assert client.cancel("lib-slow").state == "canceled"
        with pytest.raises(JobFailed) as info:
            job.result(timeout=10)
        assert info.value.state == "canceled"
        assert client.cancel("lib-slow").state == "canceled"  # again: its final state


def test_get_unknown_id_and_refused_requests(live):
    with Client(live.url) as client:
        with pytest.raises(KeyError):
            client.get("no-such-job")
        with pytest.raises(ControllerError) as info:
            client.submit("x", id="not/allowed")
        assert info.value.status == 400
        with pytest.raises(TypeError):
            client.submit(12345)
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        Client("ftp://127.0.0.1:1")


def test_the_librarys_exceptions_share_one_base_and_refusals_over_udp_are_controller_errors(
    live,
):
    assert issubclass(JobFailed, ClientError) and issubclass(ControllerError, ClientError)
    assert not issubclass(ClientError, OSError | ValueError | KeyError)
    with Client(f"udp://127.0.0.1:{live.udp_port}") as client:
        # A task this client never submitted (padded: the door answers no larger than asked).
        params = {"task_id": 1, "padding": "x" * 200}
        with pytest.raises(ClientError) as info:
            client._udp().request("get_task", params, time.monotonic() + 10)
        assert isinstance(info.value, ControllerError) and info.value.status == "unknown_task"


@pytest.mark.parametrize(
    "url",
    ["http://h", "http://h:x", "udp://h:99999", "redis://h:99999", "redis://h:x", "ftp://h:1"],
)
def test_a_url_without_a_usable_port_is_refused(url):
    with pytest.raises(ValueError, match="expected http://HOST:PORT"):
        Client(url)


def test_one_client_shared_by_threads(live):
    with Client(live.url) as client, concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda n: client.submit(f"t{n}").result(timeout=30), range(40)))
    assert results == [f"t{n}".encode() for n in range(40)]


async def _async_round(url: str) -> list[bytes]:
    async with AsyncClient(url) as client:
        jobs = [await client.submit(f"a{n}") for n in range(5)]
        out = [await job.result(timeout=20) for job in jobs]
        assert jobs[0].state == "finished" or await jobs[0].refresh() == "finished"
        return out


@pytest.mark.parametrize("scheme", ["http", "udp"])
def test_async_client_under_asyncio(live, scheme):
    url = live.url if scheme == "http" else f"udp://127.0.0.1:{live.udp_port}"
    assert asyncio.run(_async_round(url)) == [f"a{n}".encode() for n in range(5)]


@pytest.mark.parametrize("scheme", ["http", "udp"])
def test_async_client_under_trio(live, scheme):
    url = live.url if scheme == "http" else f"udp://127.0.0.1:{live.udp_port}"
    assert trio.run(_async_round, url) == [f"a{n}".encode() for n in range(5)]


def test_async_get_and_cancel(live):
    async def main() -> None:
        async with AsyncClient(live.url) as client:
            job = await client.submit("sleep again", id="lib-async-slow")
            assert (await client.get("lib-async-slow")).id == job.id
            assert (await client.cancel("lib-async-slow")).state == "canceled"
            with pytest.raises(JobFailed):
                await job.result(timeout=10)

    trio.run(main)
