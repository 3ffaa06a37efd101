"""Job controller: trio controller, worker protocol over Unix sockets, UDP front door."""
