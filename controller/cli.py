"""Command-line helpers shared by the commands: --version, --log-level, logging set-up, a
seconds argument, and a `main` that ends quietly when its reader goes away."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

import controller

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# Where the configuration keys, the decisions and the layout are explained.
DOCS = "docs/operations.md"


def version() -> str:
    """The package's version: controller.__version__, which pyproject.toml reads too."""
    return controller.__version__


def add_common_flags(parser: argparse.ArgumentParser, *, log_level: bool = True) -> None:
    """--version (every command answers it) and, for the daemons, --log-level."""
    parser.add_argument(
        "--version",
        action="version",
        version=f"{parser.prog} {version()}",
        help="print the version",
    )
    if log_level:
        parser.add_argument(
            "--log-level",
            choices=LEVELS,
            default="INFO",
            type=str.upper,
            help="least severe log lines shown (default INFO)",
        )


def setup_logging(level: str, name: str) -> None:
    """Log to stderr; under systemd (JOURNAL_STREAM set) the journal adds time and unit."""
    if os.environ.get("JOURNAL_STREAM"):
        fmt = "%(levelname)s %(name)s: %(message)s"
    else:
        fmt = f"%(asctime)s %(levelname)s {name}[%(process)d] %(name)s: %(message)s"
    logging.basicConfig(level=level.upper(), format=fmt, stream=sys.stderr, force=True)


def positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text!r}")
    return value


def quiet_pipe(main: Callable[[list[str] | None], int], argv: list[str] | None) -> int:
    """`main(argv)`, ending with status 141 and no traceback when the reader of stdout went
    away (`... | head`), as other tools do."""
    try:
        return main(argv)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
