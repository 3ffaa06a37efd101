"""The Redis door against a real redis-server under hostile keys and a full controller: a queue's
stream key holding another type stops that queue's stream alone (logged, rate-limited,
counted) and takes up again by itself once the key is fixed; the door reads no more entries
than `max_pending` leaves room for, and reads again once jobs end."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import redis
import trio

from controller.doors.redis import base
from controller.job_states import JobState
from controller.options import JobOptions
from tests.helpers import REDIS_SERVER, RedisServer, wait_until
from tests.test_redis_queues import controller_here, r, server  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (apt-get install redis-server)"
)


def _warnings_about(caplog: pytest.LogCaptureFixture, stream: str) -> int:
    return sum(
        1
        for rec in caplog.records
        if rec.name == "controller.redis"
        and rec.levelno >= logging.WARNING
        and repr(stream) in rec.getMessage()
    )


async def test_a_queue_stream_of_another_type_stops_that_queue_alone(
    sockdir: Path,
    server: RedisServer,  # noqa: F811
    r: redis.Redis,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(base, "LANE_BACKOFF_FIRST", 0.2)  # tried again sooner
    r.set("jobs.q2", "notastream")  # before the door first sets its group up
    with caplog.at_level(logging.WARNING, "controller.redis"):
        async with controller_here(sockdir, server.url) as here:
            await here.worker(queues={"default", "q2"})
            # (The test gives the worker its queues after it registered: the door sees q2
            # within a second.)
            await wait_until(lambda: here.door.status()["streams"] == ["jobs", "jobs.q2"])
            r.xadd("jobs", {"id": "flows-1", "payload": "default flows"})
            assert (await here.finished("flows-1")).result == b"default flows"
            assert here.door.status()["failing_streams"] == ["jobs.q2"]
            assert here.door.status()["connected"]  # Redis itself is fine
            # Tried again and again (counted), logged once.
            await wait_until(lambda: here.door.status()["stream_errors"] >= 3, 20)
            assert _warnings_about(caplog, "jobs.q2") == 1
            assert r.get("jobs.q2") == b"notastream"  # left as it was
            # Fixed: the queue's stream takes up by itself.
            r.delete("jobs.q2")
            r.xadd("jobs.q2", {"id": "q2-after", "payload": "q2 again"})
            job = await here.finished("q2-after")
            assert job.options.queue == "q2" and job.result == b"q2 again"
            assert here.door.status()["failing_streams"] == []
            assert any("can be used again" in rec.getMessage() for rec in caplog.records)


async def test_a_stream_key_replaced_while_read_stops_that_queue_alone(
    sockdir: Path,
    server: RedisServer,  # noqa: F811
    r: redis.Redis,  # noqa: F811
) -> None:
    async with controller_here(sockdir, server.url) as here:
        await here.worker(queues={"default", "q2"})
        r.xadd("jobs", {"id": "before-1", "payload": "a"})
        r.xadd("jobs.q2", {"id": "before-2", "payload": "b"})
        await here.finished("before-1")
        await here.finished("before-2")
        await wait_until(lambda: r.xinfo_groups("jobs.q2")[0]["pending"] == 0)
        r.delete("jobs.q2")
        r.rpush("jobs.q2", "a list now")
        for n in range(5):  # the reads go on: each of these is a read of its own
            r.xadd("jobs", {"id": f"meanwhile-{n}", "payload": str(n)})
            await here.finished(f"meanwhile-{n}")
        await wait_until(lambda: here.door.status()["failing_streams"] == ["jobs.q2"], 20)
        # The keeper goes on too: it reads the groups' counts (of the streams that work).
        await wait_until(lambda: here.door.lag == 0, 10)
        r.xadd("jobs", {"id": "counted", "requires": "nobody-has-it"})  # parked here
        await wait_until(lambda: "counted" in here.door.lanes.parked)
        await wait_until(lambda: here.door.pending == 1, 10)
        r.delete("jobs.q2")
        r.xadd("jobs.q2", {"id": "q2-back", "payload": "c"})
        assert (await here.finished("q2-back")).result == b"c"


async def test_the_door_reads_no_more_entries_than_max_pending_leaves_room_for(
    sockdir: Path,
    server: RedisServer,  # noqa: F811
    r: redis.Redis,  # noqa: F811
) -> None:
    async with controller_here(sockdir, server.url, max_pending=3) as here:
        desk = here.desk
        # Full before the door reads anything (a read issued earlier would bring its entries).
        nobody = JobOptions(queue="nobody-serves-it")
        now = trio.current_time()
        held = [
            desk.submit(
                f"held-{n}", "http", None, desk.book.pick_task_id(), b"x", now, options=nobody
            )
            for n in range(3)
        ]
        assert not desk.room(0)
        for n in range(2):
            r.xadd("jobs", {"id": f"waits-{n}", "payload": "later"})
        await here.worker()
        # Not read while there is no room (the worker is idle: only the limit holds them).
        with trio.move_on_after(2.0):
            await wait_until(lambda: desk.book.get("waits-0") is not None, 10)
        assert desk.book.get("waits-0") is None
        assert r.xinfo_groups("jobs")[0]["lag"] == 2
        desk.cancel(held[0], trio.current_time())  # room for one at a time
        await here.finished("waits-0")
        await here.finished("waits-1")
        assert (desk.live_jobs, desk.live_bytes) == (2, 2)


async def test_a_held_entrys_stream_replaced_leaves_its_job_running_and_the_keeper_going(
    tmp_path: Path,
    sockdir: Path,
    server: RedisServer,  # noqa: F811
    r: redis.Redis,  # noqa: F811
) -> None:
    release = tmp_path / "release"
    async with controller_here(sockdir, server.url) as here:
        handler = ("--handler", "tests.worker_handlers:wait_for_file")
        await here.worker(*handler, queues={"q2"})
        await here.worker(queues={"default"})
        await wait_until(lambda: here.door.status()["streams"] == ["jobs", "jobs.q2"])
        r.xadd("jobs.q2", {"id": "held-q2", "payload": str(release)})
        await wait_until(lambda: here.job_state("held-q2") is JobState.WORKING, 20)
        r.delete("jobs.q2")
        r.set("jobs.q2", "replaced while its entry is held")
        # The keeper, keeping its held entries fresh, finds that stream's key replaced: that
        # lane alone stops, and the keeper goes on with the others (their counts below).
        await wait_until(lambda: here.door.status()["failing_streams"] == ["jobs.q2"], 20)
        for n in range(2):
            r.xadd("jobs", {"id": f"parks-{n}", "requires": "nobody-has-it"})
        await wait_until(lambda: here.door.pending == 2, 10)  # those of `jobs` alone
        r.xadd("jobs", {"id": "runs", "payload": "on default"})
        assert (await here.finished("runs")).result == b"on default"
        # The held job ends as usual: its outcome is written (its entry is gone with the key).
        release.write_bytes(b"done")
        assert (await here.finished("held-q2")).result == b"plain:done"
        await wait_until(lambda: r.hget("job:held-q2", "state") == b"finished")
