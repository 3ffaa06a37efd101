"""What the UDP door's codec (codec.py) asks its shell (shell.py) to carry out.

`Submit` records and queues a new job, `Delivered` starts an ended job's retention (its
submitter has the outcome), `Send` is a datagram that leaves once the journal holds what it
announces (unless it is `independent`). The shell turns `Submit` and `Delivered` into the
job desk's `submit` and `delivered`, and holds the `Send`s with the desk's
`answer_after_commit`.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller import datagram as dg
from controller.containment import INTERNAL_MESSAGE
from controller.options import JobOptions
from controller.transmissions import Address


@dataclass(frozen=True, slots=True)
class Send:
    data: bytes
    addr: Address
    # An error reply reveals no recorded state, so it need not wait for a journal commit.
    independent: bool = False
    # An answer to a job's submitter (the acknowledgement of the add_task that made the
    # job, its notify_task and their repeats): the shell may send it with the next batch.
    batched: bool = False
    # The job this answer is about ("": none) and, for the acknowledgement of the add_task
    # that made it, the size of that request: when the journal could not record the job, an
    # `internal` error acknowledgement no larger goes instead (see `refused`), else nothing.
    job_id: str = ""
    request_size: int = 0

    def refused(self) -> Send | None:
        """What goes instead of this answer when its job could not be recorded."""
        if not self.request_size:
            return None
        packet = dg.decode(self.data)
        txid = dg.int_field(packet.get("transmission_id")) if packet is not None else None
        if txid is None:
            return None
        reply = dg.error_ack(txid, "internal", INTERNAL_MESSAGE, self.request_size)
        return Send(reply, self.addr, independent=True) if reply is not None else None


@dataclass(frozen=True, slots=True)
class Submit:
    """Record and queue a new job."""

    job_id: str
    task_id: int
    payload: bytes
    addr: Address
    options: JobOptions | None = None  # None: the door's defaults


@dataclass(frozen=True, slots=True)
class Delivered:
    """The client has the job's outcome (or the repeats ran out): keep it for retention."""

    job_id: str


# What the codec returns for a client's datagram or an ended job.
ClientAction = Send | Submit | Delivered
