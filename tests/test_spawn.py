"""worker/spawn.py: one `--exec` command served from an epoll set the caller owns."""

from __future__ import annotations

import os
import select
import shutil

import pytest
import trio

from worker.spawn import Command, Finished, spawn_and_wait

SLEEP = shutil.which("sleep") or "/bin/sleep"
CAT = shutil.which("cat") or "/bin/cat"
LIMITS = {"max_output": 1 << 20, "stderr_keep": 4096, "read_chunk": 65536}


def serve(epoll: select.epoll, command: Command) -> tuple[Finished, int]:
    """Run `command` to its end as the local worker's loop does; (what it did, wake-ups)."""
    wakes = 0
    while command.running:
        events = epoll.poll(5)
        assert events, "the command neither ended nor said anything for 5 s"
        wakes += 1
        for fd, _ in events:
            command.on_event(fd)
    return command.reap(), wakes


def test_the_payload_reaches_stdin_and_stdout_comes_back() -> None:
    with select.epoll() as epoll:
        command = Command(epoll, CAT, ["cat"], dict(os.environ), b"hello\n", **LIMITS)
        done, _ = serve(epoll, command)
    assert (done.code, bytes(done.stdout), done.too_big) == (0, b"hello\n", False)


def test_a_payload_the_command_never_reads_costs_no_busy_loop() -> None:
    """Once the payload is written, stdin's pipe leaves the epoll set. Closing the pipe alone
    left it there while the command ran (the kernel kept another reference to it), and the
    set reported it writable at every wait: hundreds of wake-ups a job, a CPU kept busy for
    as long as the command lasted."""
    with select.epoll() as epoll:
        for _ in range(5):  # the old leak showed in most runs, not all
            command = Command(epoll, SLEEP, ["sleep", "0.05"], dict(os.environ), b"x", **LIMITS)
            done, wakes = serve(epoll, command)
            assert done.code == 0
            # stdin written, stdout, stderr and the progress pipe closed, the exit: at most
            # one wake-up each
            assert wakes <= 5, f"{wakes} wake-ups for one command"
            assert epoll.poll(0) == []  # nothing of it left in the set


def test_a_failed_start_leaves_nothing_open() -> None:
    before = len(os.listdir("/proc/self/fd"))
    with select.epoll() as epoll:
        with pytest.raises(OSError):
            Command(epoll, "/nonexistent/program", ["x"], {}, b"payload", **LIMITS)
        assert len(os.listdir("/proc/self/fd")) == before + 1  # the epoll set alone


def test_kill_ends_the_process_group_and_reaps_it() -> None:
    with select.epoll() as epoll:
        command = Command(epoll, SLEEP, ["sleep", "30"], dict(os.environ), b"", **LIMITS)
        pid = command.pid
        command.kill()
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # already reaped: no zombie left
        assert epoll.poll(0) == []


def test_spawn_and_wait_runs_it_in_a_trio_task() -> None:
    async def main() -> Finished:
        return await spawn_and_wait(CAT, ["cat"], dict(os.environ), b"payload", **LIMITS)

    done = trio.run(main)
    assert (done.code, bytes(done.stdout)) == (0, b"payload")


def test_what_it_used_comes_back_with_its_exit() -> None:
    with select.epoll() as epoll:
        command = Command(epoll, CAT, ["cat"], dict(os.environ), b"x" * 100_000, **LIMITS)
        done, _ = serve(epoll, command)
    assert done.usage is not None
    assert done.usage.wall > 0 and done.usage.max_rss > 0 and done.usage.cpu >= 0
    assert done.limit == ""


def test_its_end_stops_what_it_left_in_its_process_group() -> None:
    """A background process holding its stdout no longer keeps the command running."""
    sh = shutil.which("sh") or "/bin/sh"
    with select.epoll() as epoll:
        command = Command(
            epoll, sh, ["sh", "-c", "sleep 30 & echo left"], dict(os.environ), b"", **LIMITS
        )
        done, _ = serve(epoll, command)  # serve() gives up after 5 s of silence
    assert (done.code, bytes(done.stdout)) == (0, b"left\n")
