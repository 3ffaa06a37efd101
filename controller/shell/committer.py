"""Writes the journal in group commits, from a thread, and says when each batch is on disk.

Whatever the event loop staged while the previous commit was running goes
into the next one, so the number of fsyncs follows the disk's speed, not the
number of tasks. While more than a few jobs are in flight a commit also
waits a little for more changes (`durability.batch_delay`), so that a busy
controller shares each fsync among more jobs; with fewer it starts at once.
A failed commit (disk full, I/O error) is logged loudly, kept, and retried;
meanwhile the front door refuses new tasks. A change whose values cannot be
stored (a bug that an input reached) fails alone: the journal writes the rest
of its batch (Journal.write), and `on_rejected` hears which jobs lost a change
before the answers that waited for the batch are released.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable

import trio

from controller.containment import contained
from controller.journal import Journal, Rejected
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
        on_rejected: Callable[[list[Rejected]], None] = lambda rejected: None,
    ) -> None:
        """`in_flight()`: the jobs queued or running now (what `batch_delay` is told);
        `on_rejected(changes)`: changes of a batch that could not be stored (called before
        `on_committed` for that batch)."""
        self.journal = journal
        self.on_committed = on_committed
        self.on_rejected = on_rejected
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
                        rejected = await trio.to_thread.run_sync(journal.write, batch)
                    except Exception as exc:
                        if not isinstance(exc, sqlite3.Error):  # neither the disk nor a value
                            contained(
                                "a journal commit", exc, trio.current_time(), str(journal.path)
                            )
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
                    if rejected:
                        self._rejected(rejected)
                    journal.committed_through(generation)
                    self._committed.set()
                    self._committed = trio.Event()
                    try:
                        self.on_committed()
                    except Exception as exc:  # an answer that could not go: the rest still do
                        contained("releasing answers after a commit", exc, trio.current_time())
                        self._wake.set()  # release again at the next turn
        finally:
            # Shutting down: write what is staged, synchronously (no await to be cancelled).
            if journal.dirty and not journal.failing:
                batch, generation = journal.take()
                try:
                    journal.write(batch)
                    journal.committed_through(generation)
                except Exception as exc:
                    log.error("final journal write failed: %s", exc)

    def _rejected(self, rejected: list[Rejected]) -> None:
        for change in rejected:
            log.error(
                "journal %s: a change of job ref %d cannot be stored (%s); it is refused, the "
                "rest of its batch is written",
                self.journal.path,
                change.ref,
                change.reason,
            )
        try:
            self.on_rejected(rejected)
        except Exception as exc:
            contained("refusing changes the journal cannot store", exc, trio.current_time())
