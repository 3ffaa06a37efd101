"""The doors: how jobs come in. One folder a door, each a pure codec beside its trio shell.

- `udp/`: the UDP job door (DESIGN section 3) and the calculators' link.
- `http/`: the HTTP job API, the pollers' endpoints and the operator's console.
- `redis/`: the Redis stream door shared by controllers on several hosts.

A door's shell turns what its codec decoded into calls on the job desk's door-neutral API
(controller/shell/desk.py) and sends what the desk tells it back to its clients.
"""
