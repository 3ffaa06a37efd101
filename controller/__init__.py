"""Job controller: trio controller, worker protocol over Unix sockets, UDP front door."""

# The one place the version is written: pyproject.toml reads it (dynamic), and every
# command's --version prints it.
__version__ = "0.2.0"
