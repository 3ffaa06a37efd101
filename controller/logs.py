"""Logging set-up shared by the three commands."""

from __future__ import annotations

import logging
import os
import sys

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def setup_logging(level: str, name: str) -> None:
    """Log to stderr; under systemd (JOURNAL_STREAM set) the journal adds time and unit."""
    if os.environ.get("JOURNAL_STREAM"):
        fmt = "%(levelname)s %(name)s: %(message)s"
    else:
        fmt = f"%(asctime)s %(levelname)s {name}[%(process)d] %(name)s: %(message)s"
    logging.basicConfig(level=level.upper(), format=fmt, stream=sys.stderr, force=True)
