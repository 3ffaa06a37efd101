"""Periodic jobs without processes: due times and ids (controller/schedules.py, with explicit
times and hypothesis), the config key, the journal's record, and the shell
(controller/shell/schedules.py, controller/doors/redis/periodic_claims.py) on trio's
autojump clock with a wall clock that follows it."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis
import trio
from hypothesis import given
from hypothesis import strategies as st

from controller.app import assemble
from controller.config import Config, ConfigError, parse_config
from controller.doors.redis.periodic_claims import RedisClaims
from controller.journal import Journal
from controller.schedules import Schedule, parse_entries
from controller.shell.committer import Committer
from controller.shell.refusals import JournalRefusals
from controller.shell.schedules import PeriodicJobs
from tests.helpers import controller_argv, write_config


def at(text: str) -> float:
    """An RFC 3339 UTC time as wall-clock seconds."""
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


NIGHTLY = Schedule("nightly", cron="0 3 * * *")

# ---------------------------------------------------------------- due times and ids


def test_cron_due_times_on_both_sides_of_a_due_time() -> None:
    due = at("2026-11-27T03:00:00")
    assert NIGHTLY.latest_due(due) == due
    assert NIGHTLY.latest_due(due + 0.5) == due
    assert NIGHTLY.latest_due(due - 0.001) == at("2026-11-26T03:00:00")
    assert NIGHTLY.next_due(due - 0.001) == due
    assert NIGHTLY.next_due(due) == at("2026-11-28T03:00:00")


def test_cron_reads_names_steps_and_weekdays_in_utc() -> None:
    weekdays = Schedule("w", cron="*/15 9-17 * * MON-FRI")
    friday_evening = at("2026-11-27T17:50:00")  # a Friday
    assert weekdays.latest_due(friday_evening) == at("2026-11-27T17:45:00")
    assert weekdays.next_due(friday_evening) == at("2026-11-30T09:00:00")  # Monday


def test_every_due_times_are_multiples_since_the_epoch() -> None:
    hourly = Schedule("h", every=3600)
    assert hourly.latest_due(at("2026-11-27T06:59:59.9")) == at("2026-11-27T06:00:00")
    assert hourly.latest_due(at("2026-11-27T07:00:00")) == at("2026-11-27T07:00:00")
    assert hourly.next_due(at("2026-11-27T07:00:00")) == at("2026-11-27T08:00:00")
    seven = Schedule("s", every=7)
    assert seven.latest_due(20.0) == 14.0 and seven.next_due(20.0) == 21.0
    assert seven.next_due(21.0) == 28.0


def test_job_id_names_the_schedule_and_the_utc_second() -> None:
    assert NIGHTLY.job_id(at("2026-11-27T03:00:00")) == "cron-nightly-20261127T030000Z"
    assert Schedule("a.b_c-1", every=1).job_id(0.0) == "cron-a.b_c-1-19700101T000000Z"


EXPRESSIONS = [
    "* * * * *",
    "0 3 * * *",
    "*/7 * * * *",
    "30 2 1 * *",
    "0 0 29 2 *",
    "15 10 * * 1,3,5",
    "0 12 L * *",
    "0 8 * * 5#2",
    "59 23 31 12 *",
]
times = st.floats(min_value=0, max_value=4_000_000_000, allow_nan=False)


def schedules() -> st.SearchStrategy[Schedule]:
    every = st.integers(min_value=1, max_value=10_000_000).map(lambda n: Schedule("e", every=n))
    cron = st.sampled_from(EXPRESSIONS).map(lambda text: Schedule("c", cron=text))
    return st.one_of(every, cron)


@given(schedules(), times)
def test_latest_is_at_or_before_now_and_nothing_due_between(schedule: Schedule, now: float):
    latest = schedule.latest_due(now)
    assert latest <= now
    assert schedule.next_due(latest) > now  # nothing due in (latest, now]
    assert schedule.latest_due(latest) == latest  # a due time is due at itself
    assert latest == int(latest)  # whole seconds: the id names them exactly


@given(schedules(), times)
def test_next_is_after_t_and_the_first_such(schedule: Schedule, t: float):
    following = schedule.next_due(t)
    assert following > t
    assert schedule.latest_due(following) == following
    assert schedule.latest_due(following - 0.5) <= t  # nothing due in (t, following)


@given(st.integers(min_value=1, max_value=10_000_000), times)
def test_every_due_times_are_multiples_of_every(every: int, t: float):
    schedule = Schedule("e", every=every)
    for due in (schedule.latest_due(t), schedule.next_due(t)):
        assert due % every == 0
    assert schedule.next_due(t) - schedule.latest_due(t) == every


@given(schedules(), times, st.integers(min_value=1, max_value=5))
def test_ids_are_unique_per_due_time_and_name_it(schedule: Schedule, t: float, steps: int):
    dues = [schedule.next_due(t)]
    for _ in range(steps):
        dues.append(schedule.next_due(dues[-1]))
    ids = [schedule.job_id(due) for due in dues]
    assert len(set(ids)) == len(ids)
    for due, job_id in zip(dues, ids, strict=True):
        stamp = job_id.removeprefix(f"cron-{schedule.name}-")
        parsed = datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
        assert parsed.timestamp() == due


# ---------------------------------------------------------------- the config key


def test_schedules_are_read_from_the_config() -> None:
    config = parse_config(
        {
            "schedules": [
                {"name": "nightly", "cron": "0  3 * * *", "payload": "go", "priority": 5},
                {"name": "tick", "every": 60.0, "queue": "fast"},
            ]
        }
    )
    assert config.schedules == (
        Schedule("nightly", cron="0 3 * * *", payload="go", priority=5),
        Schedule("tick", every=60, queue="fast"),
    )
    assert parse_config({"schedules": []}) == Config()


@pytest.mark.parametrize(
    ("entries", "says"),
    [
        ({"name": "x", "every": 1}, "must be a list"),
        ([["x"]], "entry 0: must be an object"),
        ([{"name": "Nightly", "every": 1}], "name must match"),
        ([{"every": 1}], "name must match"),
        ([{"name": "x"}], "exactly one of cron and every"),
        ([{"name": "x", "every": 1, "cron": "* * * * *"}], "exactly one of cron and every"),
        ([{"name": "x", "cron": "0 3 * *"}], "five fields"),
        ([{"name": "x", "cron": "0 0 3 * * *"}], "five fields"),
        ([{"name": "x", "cron": "@daily"}], "five fields"),
        ([{"name": "x", "cron": "0 25 * * *"}], "not a valid expression: Bad hour"),
        ([{"name": "x", "cron": "0 0 30 2 *"}], "not a valid expression"),
        ([{"name": "x", "cron": 5}], "cron must be"),
        ([{"name": "x", "every": 0}], "every must be from 1"),
        ([{"name": "x", "every": -5}], "every must be from 1"),
        ([{"name": "x", "every": 1.5}], "whole number of seconds"),
        ([{"name": "x", "every": True}], "whole number of seconds"),
        ([{"name": "x", "every": 1, "payload": 3}], "payload must be text"),
        ([{"name": "x", "every": 1, "payload": "\ud800"}], "lone surrogate"),
        ([{"name": "x", "every": 1, "queue": "A B"}], "queue must match"),
        ([{"name": "x", "every": 1, "priority": 101}], "priority must be an integer"),
        ([{"name": "x", "every": 1, "priority": 1.0}], "priority must be an integer"),
        ([{"name": "x", "every": 1, "when": 1}], "unknown member 'when'"),
        ([{"name": "x", "every": 1}, {"name": "x", "every": 2}], "entry 1: the name 'x'"),
    ],
)
def test_a_bad_entry_is_a_start_up_error_naming_the_key(entries: Any, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"schedules": entries}, "ctl.json")
    message = str(caught.value)
    assert message.startswith("ctl.json: key 'schedules' ")
    assert says in message


def test_the_controller_refuses_a_bad_schedule_with_exit_status_2(tmp_path: Path) -> None:
    config = write_config(tmp_path, schedules=[{"name": "x", "cron": "0 3 * *"}])
    done = subprocess.run(controller_argv(config), capture_output=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.decode().startswith(f"controller: {config}: key 'schedules' entry 0")


def test_the_error_names_the_entry_by_index_and_name() -> None:
    with pytest.raises(ValueError, match=r"^entry 1 \('late'\): every must be"):
        parse_entries([{"name": "ok", "every": 1}, {"name": "late", "every": 0}])


# ---------------------------------------------------------------- the journal's record


def test_the_journal_keeps_each_schedules_last_due_time(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite3"
    journal = Journal.open(path)
    assert journal.load().schedules == {}
    journal.schedule_due("nightly", 100.0)
    journal.schedule_due("tick", 5.0)
    journal.schedule_due("nightly", 200.0)
    batch, _ = journal.take()
    assert journal.write(batch) == []
    journal.close()
    again = Journal.open(path)
    assert again.load().schedules == {"nightly": 200.0, "tick": 5.0}
    again.close()


# ---------------------------------------------------------------- the shell

BASE = 1_800_000_005.0  # the fake wall clock at trio time 0: 5 s past a multiple of 10


def fake_wall() -> float:
    return BASE + trio.current_time()


def config_with(sockdir: Path, *schedules: Schedule, **settings: Any) -> Config:
    return Config(socket_dir=sockdir, journal=None, schedules=schedules, **settings)


@asynccontextmanager
async def controller(config: Config, journal: Journal | None = None) -> AsyncIterator[Any]:
    """The controller's parts with the scheduler's shell serving; the nursery to add to."""
    ctl = assemble(config, journal)
    shell, desk, _ = ctl.shell, ctl.desk, ctl.udp
    async with trio.open_nursery() as nursery:
        await nursery.start(shell.serve)
        yield desk, nursery
        nursery.cancel_scope.cancel()


def made(desk: Any) -> list[str]:
    return sorted(job.id for job in desk.book if job.id.startswith("cron-"))


def tick_id(seconds: float) -> str:
    return Schedule("tick", every=10).job_id(seconds)


async def test_a_new_schedule_starts_at_its_next_due_time(
    sockdir: Path, autojump_clock: Any
) -> None:
    tick = Schedule("tick", every=10, payload="hello", queue="fast", priority=7)
    config = config_with(sockdir, tick, max_retries=5, task_timeout=30.0)
    async with controller(config) as (desk, nursery):
        periodic = PeriodicJobs(config, desk, wall=fake_wall)
        await nursery.start(periodic.run)
        assert made(desk) == []  # 1_800_000_000 is past: not made for a new schedule
        await trio.sleep(4.9)
        assert made(desk) == []
        await trio.sleep(0.2)
        assert made(desk) == [tick_id(BASE + 5)]
        await trio.sleep(20)
        assert made(desk) == [tick_id(BASE + s) for s in (5, 15, 25)]
    job = desk.book.get(tick_id(BASE + 5))
    assert job is not None
    assert (job.door, job.payload, periodic.made) == ("http", b"hello", 3)
    options = job.options
    assert (options.queue, options.priority, options.owner) == ("fast", 7, "schedule-tick")
    assert (options.max_retries, options.timeout, options.placement_timeout) == (5, 30.0, 0.0)
    assert options.run_at is None


async def test_the_latest_missed_due_time_is_made_once_at_start(
    sockdir: Path, autojump_clock: Any
) -> None:
    tick = Schedule("tick", every=10)
    config = config_with(sockdir, tick)
    async with controller(config) as (desk, nursery):
        # Made last at BASE - 35; BASE - 25, - 15 and - 5 were missed.
        periodic = PeriodicJobs(config, desk, last_due={"tick": BASE - 35}, wall=fake_wall)
        await nursery.start(periodic.run)
        await trio.sleep(1)
        assert made(desk) == [tick_id(BASE - 5)]
        await trio.sleep(5)
        assert made(desk) == [tick_id(BASE - 5), tick_id(BASE + 5)]
    assert periodic.last_due == {"tick": BASE + 5}


async def test_a_due_time_already_made_is_not_made_again(
    sockdir: Path, autojump_clock: Any
) -> None:
    tick = Schedule("tick", every=10)
    config = config_with(sockdir, tick)
    async with controller(config) as (desk, nursery):
        # Journaled as made: nothing at start.
        periodic = PeriodicJobs(config, desk, last_due={"tick": BASE - 5}, wall=fake_wall)
        # The next one is in the book already (here: posted by hand with its id).
        taken = desk.submit(tick_id(BASE + 5), "http", None, desk.book.pick_task_id(), b"mine", 0.0)
        await nursery.start(periodic.run)
        await trio.sleep(1)
        assert made(desk) == [tick_id(BASE + 5)]
        await trio.sleep(15)
        assert made(desk) == [tick_id(BASE + 5), tick_id(BASE + 15)]
    assert desk.book.get(tick_id(BASE + 5)) is taken and taken.payload == b"mine"
    assert periodic.made == 1


class FakeClaims:
    """Answers each claim from a list (True, False, None) and records what was asked."""

    def __init__(self, answers: list[bool | None]) -> None:
        self.answers = answers
        self.asked: list[tuple[str, float]] = []

    async def claim(self, job_id: str, until: float) -> bool | None:
        self.asked.append((job_id, until))
        return self.answers.pop(0)


async def test_only_a_claimed_due_time_is_made(sockdir: Path, autojump_clock: Any) -> None:
    tick = Schedule("tick", every=10)
    config = config_with(sockdir, tick)
    claims = FakeClaims([True, False, None, True])
    async with controller(config) as (desk, nursery):
        periodic = PeriodicJobs(config, desk, claims=claims, wall=fake_wall)
        await nursery.start(periodic.run)
        await trio.sleep(36)
        assert made(desk) == [tick_id(BASE + 5), tick_id(BASE + 35)]
    dues = [BASE + s for s in (5, 15, 25, 35)]
    assert claims.asked == [(tick_id(due), due + 10) for due in dues]


async def test_a_refusing_journal_makes_nothing_and_says_so(
    sockdir: Path, autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    tick = Schedule("tick", every=10)
    config = config_with(sockdir, tick)
    async with controller(config) as (desk, nursery):
        desk.refusal = lambda: "disk full"
        periodic = PeriodicJobs(config, desk, wall=fake_wall)
        await nursery.start(periodic.run)
        await trio.sleep(6)
        assert made(desk) == []
    assert f"job {tick_id(BASE + 5)} not made: the journal cannot record new jobs now" in (
        caplog.text
    )
    assert "disk full" in caplog.text


async def test_due_times_passed_at_once_are_made_in_order_up_to_a_limit(
    sockdir: Path, autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    config = config_with(sockdir, Schedule("tick", every=10))
    ahead = [0.0]  # the wall clock set forward by this much

    def wall() -> float:
        return fake_wall() + ahead[0]

    async with controller(config) as (desk, nursery):
        periodic = PeriodicJobs(config, desk, wall=wall)
        await nursery.start(periodic.run)
        await trio.sleep(6)
        assert made(desk) == [tick_id(BASE + 5)]
        ahead[0] = 30.0  # over three due times: each is made at the next wake-up
        await trio.sleep(10)
        assert made(desk) == [tick_id(BASE + s) for s in (5, 15, 25, 35, 45)]
        ahead[0] = 30.0 + 3600  # an hour: only the latest
        await trio.sleep(10)
        assert made(desk)[5:] == [tick_id(BASE + 3600 + 55)]
    assert "making only the latest" in caplog.text


async def test_a_failure_while_making_one_job_costs_that_due_time_alone(
    sockdir: Path, autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    config = config_with(sockdir, Schedule("tick", every=10))
    async with controller(config) as (desk, nursery):
        real = desk.submit
        calls = []

        def broken_once(*args: Any, **kwargs: Any) -> Any:
            calls.append(args[0])
            if len(calls) == 1:
                raise RuntimeError("a bug")
            return real(*args, **kwargs)

        desk.submit = broken_once
        periodic = PeriodicJobs(config, desk, wall=fake_wall)
        await nursery.start(periodic.run)
        await trio.sleep(16)
        assert made(desk) == [tick_id(BASE + 15)]
    assert calls == [tick_id(BASE + 5), tick_id(BASE + 15)]
    assert "making a periodic job" in caplog.text and "RuntimeError" in caplog.text


async def test_the_due_time_is_journaled_with_its_job(
    sockdir: Path, tmp_path: Path, autojump_clock: Any
) -> None:
    path = tmp_path / "journal.sqlite3"
    journal = Journal.open(path, "normal")
    tick = Schedule("tick", every=10)
    config = Config(socket_dir=sockdir, journal=path, schedules=(tick,))
    recovered = journal.load()
    async with controller(config, journal) as (desk, nursery):
        refusals = JournalRefusals(desk)
        committer = Committer(
            journal, on_committed=refusals.committed, on_rejected=refusals.rejected
        )
        await nursery.start(committer.run)
        periodic = PeriodicJobs(config, desk, journal, recovered.schedules, wall=fake_wall)
        async with trio.open_nursery() as making:
            await making.start(periodic.run)
            # Commits run in a thread, which the clock may jump over: count, not time.
            with trio.fail_after(10**7):  # virtual seconds: the clock jumps while commits run
                while periodic.made < 2:
                    await trio.sleep(1)
            making.cancel_scope.cancel()  # no job made after the commit waited for below
        await desk.write_ahead.committed()
        ids = made(desk)
    journal.close()
    again = Journal.open(path)
    recovered = again.load()
    again.close()
    assert len(ids) >= 2
    assert sorted(row.id for row in recovered.jobs) == ids
    assert recovered.schedules == periodic.last_due
    assert tick.job_id(recovered.schedules["tick"]) == ids[-1]


# ---------------------------------------------------------------- Redis claims


class FakeRedis:
    """SET NX and GET on a dict; fails with ConnectionError while `down` counts down."""

    def __init__(self, down: int = 0) -> None:
        self.keys: dict[str, bytes] = {}
        self.down = down
        self.ttls: list[int] = []

    def _reach(self) -> None:
        if self.down:
            self.down -= 1
            raise redis.ConnectionError("connection refused")

    def set(self, key: str, value: str, nx: bool, ex: int) -> bool | None:
        self._reach()
        assert nx
        self.ttls.append(ex)
        if key in self.keys:
            return None
        self.keys[key] = value.encode()
        return True

    def get(self, key: str) -> bytes | None:
        self._reach()
        return self.keys.get(key)


async def inline(fn: Any, *args: Any, abandon_on_cancel: bool = False) -> Any:
    return fn(*args)


async def test_a_claim_is_won_once_and_kept_by_its_holder(autojump_clock: Any) -> None:
    fake = FakeRedis()
    one = RedisClaims(fake, "host-a", 3600, inline, wall=fake_wall)
    two = RedisClaims(fake, "host-b", 3600, inline, wall=fake_wall)
    until = BASE + 10
    assert await one.claim("cron-x-1", until) is True
    assert await two.claim("cron-x-1", until) is False
    assert await one.claim("cron-x-1", until) is True  # claimed, then crashed: still ours
    assert fake.keys == {"cron:cron-x-1": b"host-a"}
    assert fake.ttls[0] == 10 + 86400  # a day past the next due time


async def test_an_unreachable_redis_is_retried_until_the_next_due_time(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeRedis(down=5)
    claims = RedisClaims(fake, "host-a", 3600, inline, wall=fake_wall)
    start = trio.current_time()
    assert await claims.claim("cron-x-1", BASE + 60) is True
    assert 0 < trio.current_time() - start < 5  # backoff 0.1 s, doubling
    assert caplog.text.count("cannot claim periodic job cron-x-1") == 1
    fake.down = 10**6
    start = trio.current_time()
    assert await claims.claim("cron-x-2", fake_wall() + 30) is None
    assert trio.current_time() - start == pytest.approx(30)
