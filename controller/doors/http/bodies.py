"""Reading a request's body within its size limit, for the HTTP door's shell.

A body over its limit is 413; a bounded amount more is read and dropped first, so that a
client still sending gets to read the answer. `POST /job/` takes an array of jobs too, whose
limit is larger (codec.max_bulk_body): which limit holds is known from the body's first
character that is not white space, so a single job's body keeps the smaller one.
"""

from __future__ import annotations

from controller.doors.http.asgi import BodyTimeout, ClientDisconnect, Request
from controller.doors.http.codec import ApiError

# How much of a body over the limit is read and dropped before the 413 goes out.
DRAIN_LIMIT = 4 * 1024 * 1024


class BodyBudget:
    """The bytes of request bodies held while they are read, all connections together. Each
    body is bounded by its own limit; this bounds their sum, so that many slow uploads at once
    cannot take the controller's memory: past `limit` a request is answered 503 (try again).
    One client address holds at most half of it, so that it cannot lock the others out."""

    __slots__ = ("by_client", "held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.by_client: dict[str, int] = {}

    def take(self, client: str, size: int) -> bool:
        """Hold `size` more bytes for `client`'s body; False (nothing held) past a limit."""
        mine = self.by_client.get(client, 0)
        if self.held + size > self.limit or mine + size > self.limit // 2:
            return False
        self.held += size
        self.by_client[client] = mine + size
        return True

    def give(self, client: str, size: int) -> None:
        """`size` bytes `client` held are free again."""
        if not size:
            return
        self.held -= size
        left = self.by_client[client] - size
        if left:
            self.by_client[client] = left
        else:
            del self.by_client[client]


async def read_body(
    request: Request,
    limit: int,
    idle: float,
    deadline: float,
    array_limit: int = 0,
    budget: BodyBudget | None = None,
) -> bytes:
    """The request's body, at most `limit` bytes (else ApiError 413), or `array_limit` when it
    is a JSON array and that is larger; `idle`: the longest silence in the middle of it,
    `deadline`: when its last byte must have come (trio clock; else 408); `budget`: what all
    bodies being read may hold together (else 503)."""
    largest = max(limit, array_limit)
    declared = request.header(b"content-length")
    known = int(declared) if declared is not None and declared.isdigit() else None
    too_big = known is not None and known > largest
    undecided = largest > limit  # until the first character says which limit holds
    chunks: list[bytes] = []
    size = 0
    taken = 0  # of the budget
    crowded = False
    peer = request.scope.get("client")
    client = str(peer[0]) if peer else ""
    try:
        async for chunk in request.stream(idle, deadline):
            size += len(chunk)
            if undecided:
                first = chunk.lstrip()  # the chunks before were white space alone
                if first:
                    undecided = False
                    if first.startswith(b"["):
                        limit = largest
                    elif known is not None and known > limit:
                        too_big = True
            if size > (largest if undecided else limit):
                too_big = True
            if budget is not None and not (too_big or crowded):
                if budget.take(client, len(chunk)):
                    taken += len(chunk)
                else:
                    crowded = True
                    budget.give(client, taken)
                    taken = 0
                    chunks.clear()
            if too_big or crowded:
                # Read (and drop) a bounded amount more, so that the client, still sending,
                # gets to read its 413 or 503; past that the connection is simply closed.
                if size > limit + DRAIN_LIMIT:
                    break
                continue
            chunks.append(chunk)
    except ClientDisconnect:  # it went away mid-body: nobody to answer, nothing done
        raise ApiError(400, "the client closed the connection before the body ended") from None
    except BodyTimeout as exc:  # answered, and the connection closed: the body is unread
        raise ApiError(408, str(exc)) from None
    finally:
        if budget is not None:
            budget.give(client, taken)
    if too_big:
        raise ApiError(413, f"the body is over {limit} bytes")
    if crowded:
        raise ApiError(503, "too many request bodies are being read at once: try again")
    return b"".join(chunks)
