"""What a worker declares: the queues it takes jobs from and the labels it has. Pure.

Every worker kind declares the same two lists of names, each in its own way: a local
worker in REGISTER's repeated `queues` and `labels` fields, a calculator as JSON lists in
every heartbeat's params, a poller as comma separated text in `/ping/`'s query. The
`worker` command reads them from `--queues` and `--labels`. Both sides check them with
`read`: every name follows the queue-name rule of job options, a list holds at most
`MAX_NAMES`, and all the names together at most `MAX_NAME_CHARS` characters, so that a
REGISTER carrying the most that is allowed still fits the wire's 4 KiB header
(controller/wire.py). A worker that declares no queue serves `default`; one that declares
no label has none.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.options import DEFAULT_QUEUE, NAME_RULE, valid_name

# Names in one list (queues, or labels) at most: what `requires` takes, too.
MAX_NAMES = 32
# Characters of all the names of both lists together, at most: with the protobuf framing
# (2 bytes a name) and the pulse's other fields, a REGISTER stays well under 4 KiB.
MAX_NAME_CHARS = 2048
# The longest comma separated text read at all: the most names, each with a comma and a blank.
MAX_TEXT = MAX_NAMES * (64 + 2)
SERVES_DEFAULT = frozenset({DEFAULT_QUEUE})


class BadDeclaration(ValueError):
    """A declared list is refused: `what` names the list, `why` says why."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")
        self.what = what
        self.why = why


@dataclass(frozen=True, slots=True)
class Declared:
    """A worker's queues (never empty) and labels."""

    queues: frozenset[str] = SERVES_DEFAULT
    labels: frozenset[str] = frozenset()


DEFAULT = Declared()


def names(value: object, what: str) -> tuple[str, ...]:
    """One declared list: a list of names, or comma separated text (blanks around a name
    are ignored, an empty text is no name). Raises BadDeclaration."""
    if isinstance(value, str):
        if len(value) > MAX_TEXT:
            raise BadDeclaration(what, f"more than {MAX_TEXT} characters")
        value = [part.strip() for part in value.split(",")] if value.strip() else []
    if not isinstance(value, list | tuple):
        raise BadDeclaration(what, f"a list of names is wanted, got {type(value).__name__}")
    if len(value) > MAX_NAMES:
        raise BadDeclaration(what, f"at most {MAX_NAMES} names, got {len(value)}")
    for name in value:
        if not valid_name(name):
            given = name[:80] if isinstance(name, str) else name
            raise BadDeclaration(what, f"a name must match {NAME_RULE}, got {given!r}")
    return tuple(dict.fromkeys(value))  # in the given order, each once


def read(queues: object = (), labels: object = ()) -> Declared:
    """A worker's declaration from its two lists (each as `names` takes it); no queue means
    `default`. Raises BadDeclaration."""
    queue_names = names(queues, "queues")
    label_names = names(labels, "labels")
    total = sum(map(len, queue_names)) + sum(map(len, label_names))
    if total > MAX_NAME_CHARS:
        raise BadDeclaration(
            "queues and labels", f"{total} characters of names, more than {MAX_NAME_CHARS}"
        )
    if not label_names and queue_names in ((), (DEFAULT_QUEUE,)):
        return DEFAULT  # most workers: one shared record
    return Declared(
        frozenset(queue_names) if queue_names else SERVES_DEFAULT, frozenset(label_names)
    )


def shown(names: frozenset[str], limit: int = 0) -> str:
    """A list of names as status views show it: sorted, comma separated. With a `limit`,
    the names that fit in it and then `,...` (or the one name cut, with `...`): a long
    declaration must not crowd out the rest of a small report."""
    text = ",".join(sorted(names))
    if not limit or len(text) <= limit:
        return text
    cut = text.rfind(",", 0, limit - 3)
    return text[:cut] + ",..." if cut > 0 else text[: limit - 3] + "..."
