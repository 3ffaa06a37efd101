"""The error a worker's setup raises: a flag, a job user, a limit, a handler or a command
that cannot be used. `worker` prints it and exits 2."""


class SetupError(Exception):
    """A job user, a limit, --user, --exec or --handler that cannot be used; the worker exits 2."""
