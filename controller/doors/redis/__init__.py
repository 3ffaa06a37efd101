"""The Redis stream door (docs/redis.md): jobs from Redis streams shared by controllers on
several hosts.

- `codec.py`: the keys, names and Lua scripts of the streams, shared with the client. Pure.
- `stream_calls.py`: the door's blocking redis-py calls, and its scripts' arguments and answers.
- `script_link.py`: the busy-path link that runs the scripts on the controller's reactor.
- `queue_lanes.py`: one stream per queue, the room each has, and the parked entries.
- `base.py`, `reading.py`, `writing.py`, `keeping.py`, `listening.py`, `door.py`: the
  trio shell, `RedisDoor` (door.py), one module per task over a shared base.
- `periodic_claims.py`: Redis claims of periodic jobs, so that one controller of several
  makes each due time's job.
"""
