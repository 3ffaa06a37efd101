"""The errors that stop the controller before it serves: each says, for the operator, why it
cannot start (the controller prints it and exits with status 2)."""

from __future__ import annotations


class CannotStart(Exception):
    """The controller cannot start; the message is for the operator (exit status 2)."""


class StartupError(CannotStart):
    """A resource the controller needs at start is unusable: its socket directory, main.sock,
    another door's address, a job user."""
