from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """A short temporary socket directory (Unix socket paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="jc-"))
    path.chmod(0o750)
    yield path
    shutil.rmtree(path, ignore_errors=True)
