"""The local worker: one process on the controller's host, registered on main.sock, running
one job at a time in one epoll loop (`worker.local.worker.LocalWorker`).

Its floors, each resting on the one before: `base` (the epoll set, signals, the drain),
`job` (the running job and its output), `seed` (the seed's exchange: a connection per
message, a control socket) and `channel` (one connection for the worker's life), and
`worker` (the loop itself, its timers, registration and pulses).
"""
