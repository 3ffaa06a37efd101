"""Writes the journal in group commits, from a thread, and says when each batch is on disk.

Whatever the event loop staged while the previous commit was running goes
into the next one, so the number of fsyncs follows the disk's speed, not the
number of tasks. While more than a few jobs are in flight a commit also
waits a little for more changes (`durability.batch_delay`), so that a busy
controller shares each fsync among more jobs; with fewer it starts at once.
A failed commit (disk full, I/O error) is logged loudly, kept, and retried;
meanwhile the front door refuses new tasks.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable

import trio

from controller.journal import Journal
from controller.shell.durability import batch_delay

log = logging.getLogger("controller.journal")

# Pause between attempts while the journal cannot be written.
RETRY_INTERVAL = 1.0


class Committer:
    def __init__(
        self,
        journal: Journal,
        on_committed: Callable[[], None] = lambda: None,
        in_flight: Callable[[], int] = lambda: 0,
    ) -> None:
        """`in_flight()`: the jobs queued or running now (what `batch_delay` is told)."""
        self.journal = journal
        self.on_committed = on_committed
        self.in_flight = in_flight
        self._wake = trio.Event()
        self._committed = trio.Event()
        journal.on_dirty = self._kick

    def _kick(self) -> None:
        self._wake.set()

    async def wait_for(self, generation: int) -> None:
        """Return once every change of `generation` (and before) is on disk."""
        while self.journal.committed < generation:
            await self._committed.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        journal = self.journal
        task_status.started()
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                while journal.dirty:
                    delay = batch_delay(self.in_flight())
                    if delay:
                        await trio.sleep(delay)
                    batch, generation = journal.take()
                    try:
                        await trio.to_thread.run_sync(journal.write, batch)
                    except sqlite3.Error as exc:
                        journal.restage(batch)
                        if not journal.failing:
                            log.error(
                                "JOURNAL WRITE FAILED on %s: %s; refusing new tasks until it "
                                "can be written again (retrying every %g s)",
                                journal.path,
                                exc,
                                RETRY_INTERVAL,
                            )
                        journal.failing = str(exc)
                        await trio.sleep(RETRY_INTERVAL)
                        continue
                    if journal.failing:
                        log.warning("journal %s writable again; accepting tasks", journal.path)
                        journal.failing = ""
                    journal.committed_through(generation)
                    self._committed.set()
                    self._committed = trio.Event()
                    self.on_committed()
        finally:
            # Shutting down: write what is staged, synchronously (no await to be cancelled).
            if journal.dirty and not journal.failing:
                batch, generation = journal.take()
                try:
                    journal.write(batch)
                    journal.committed_through(generation)
                except sqlite3.Error as exc:
                    log.error("final journal write failed: %s", exc)
