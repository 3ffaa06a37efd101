from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from controller.config import Config
from controller.core import TaskFinished
from controller.shell.server import ControllerShell


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """A short temporary socket directory (Unix socket paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="jc-"))
    path.chmod(0o750)
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Outcomes:
    """Collects finished tasks; `wait(n)` blocks until n have arrived."""

    def __init__(self) -> None:
        self.items: list[TaskFinished] = []
        self._changed = trio.Event()

    def __call__(self, finished: TaskFinished) -> None:
        self.items.append(finished)
        self._changed.set()
        self._changed = trio.Event()

    async def wait(self, count: int = 1, timeout: float = 10.0) -> list[TaskFinished]:
        with trio.fail_after(timeout):
            while len(self.items) < count:
                await self._changed.wait()
        return self.items


@asynccontextmanager
async def running_controller(
    sockdir: Path, **settings: object
) -> AsyncIterator[tuple[ControllerShell, Outcomes]]:
    outcomes = Outcomes()
    config = Config(socket_dir=sockdir, journal=None).replace(**settings)
    shell = ControllerShell(config, on_finished=outcomes)
    async with trio.open_nursery() as nursery:
        await nursery.start(shell.serve)
        yield shell, outcomes
        nursery.cancel_scope.cancel()
