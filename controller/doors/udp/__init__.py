"""The UDP door (DESIGN section 3): clients' datagrams, and the calculators' on the same port.

- `codec.py`: pure. A datagram in, actions out: the client methods, and the routing of
  every datagram to the clients' side or the calculators' (`allowed_calculators`).
- `actions.py`: what the codec asks the shell to carry out for clients (`Submit`,
  `Delivered`, `Send`).
- `calclink.py`: pure. The calculators' datagrams (`heartbeat`, `completed_task`) and the
  repeats of `perform_task` until it is acknowledged.
- `shell.py`: the trio shell. The socket, the door's timer, the batches of answers; it carries
  out the clients' actions with the job desk and hands the calculators' to `calculators.py`.
- `calculators.py`: the calculators' shell. What they say reaches the calculator worker kind
  (controller/core/calculators.py), as the pollers' requests reach theirs.
"""
