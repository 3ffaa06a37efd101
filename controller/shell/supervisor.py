"""`controller --workers N`: start N local worker processes and keep them running.

Each slot restarts its worker when it exits, saying why (status or signal).
Exit 75 (the worker obeyed RESTART) is expected and restarted at once; a
worker that keeps dying soon after start is restarted with a doubling delay,
so a broken handler does not turn into a fork loop. On shutdown the workers
get SIGTERM (they drain), then SIGKILL if they linger.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys

import trio

from controller import priority
from controller.shell.descriptors import Throttled

log = logging.getLogger("controller.supervisor")

# A worker that lived this long was healthy: its next restart starts from the short delay.
HEALTHY_RUN = 10.0
BACKOFF_START = 0.1
BACKOFF_MAX = 30.0
# How long stopping workers may drain before they are killed.
STOP_GRACE = 10.0


def worker_command(socket_dir: str, extra: list[str], job_user: str | None = None) -> list[str]:
    """A local worker's command line: `extra` (the arguments after --) last, since --exec
    takes everything after it; `job_user` (the slot's, config job_users) before them."""
    return [
        sys.executable,
        "-m",
        "worker",
        "--socket-dir",
        socket_dir,
        # The controller's own pid: a worker that starts after the controller has gone (its
        # parent is then init or a subreaper) sees that and exits at once.
        "--exit-with-parent",
        str(os.getpid()),
        *(["--job-user", job_user] if job_user is not None else []),
        *extra,
    ]


def describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


class Supervisor:
    def __init__(
        self,
        count: int,
        argv: list[str],
        cpus: frozenset[int] | None = None,
        nice: int | None = None,
        slot_argvs: list[list[str]] | None = None,
    ) -> None:
        """Slots 0..count-1. `cpus`: the CPUs workers may use when the controller pinned
        itself elsewhere (a worker given its own --cpus sets its own); `nice`: the nice value
        they run at when the controller changed its own (controller/priority.py);
        `slot_argvs`: a command line per slot instead of `argv` (each with its --job-user,
        config job_users)."""
        self.count = count
        self.argv = argv
        self.slot_argvs = slot_argvs or []
        own = any(arg == "--cpus" or arg.startswith("--cpus=") for arg in argv)
        self.cpus = None if own else cpus
        self.nice = nice
        self.restarts = 0
        self.pids: dict[int, int] = {}  # slot -> pid
        self._spawn_failed = Throttled(log, "cannot start a local worker")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for slot in range(self.count):
                nursery.start_soon(self._keep_running, slot)
            task_status.started()

    def slot_argv(self, slot: int) -> list[str]:
        """The command line of slot `slot`'s worker."""
        return self.slot_argvs[slot] if slot < len(self.slot_argvs) else self.argv

    async def _keep_running(self, slot: int) -> None:
        delay = BACKOFF_START
        argv = self.slot_argv(slot)
        while True:
            started = trio.current_time()
            # Its own session: a Ctrl-C at the terminal reaches only the controller, which then
            # stops the workers once (they drain); --exit-with-parent covers a SIGKILLed controller.
            try:
                proc = await trio.lowlevel.open_process(argv, start_new_session=True)
            except OSError as exc:  # out of descriptors or processes: not fatal, try again
                self._spawn_failed(f"worker slot {slot}: {exc.strerror or exc}", started)
                await trio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX)
                continue
            if self.cpus is not None:
                # It inherited the controller's CPUs; Python is still starting up.
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setaffinity(proc.pid, self.cpus)
            if self.nice is not None:
                priority.restore(proc.pid, self.nice)  # it inherited the controller's
            self.pids[slot] = proc.pid
            log.info("worker slot %d: started pid %d", slot, proc.pid)
            try:
                code = await proc.wait()
            finally:
                if proc.returncode is None:
                    with trio.CancelScope(shield=True):
                        proc.send_signal(signal.SIGTERM)
                        with trio.move_on_after(STOP_GRACE):
                            await proc.wait()
                        if proc.returncode is None:
                            proc.kill()
                            await proc.wait()
            self.pids.pop(slot, None)
            ran = trio.current_time() - started
            if ran >= HEALTHY_RUN or code == 75:
                delay = BACKOFF_START
            self.restarts += 1
            log.warning(
                "worker slot %d: pid %d %s after %.1f s; restarting in %.1f s",
                slot,
                proc.pid,
                describe_exit(code),
                ran,
                delay,
            )
            await trio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX)
