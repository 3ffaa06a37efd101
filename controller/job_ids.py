"""What names a job, through any door or the client: the door it came in by (`DoorName`),
the id's characters and length, the ids kept for UDP jobs, and the longest text a job's
fields take."""

from __future__ import annotations

import enum


class DoorName(enum.StrEnum):
    """The door a job came in by. A member equals and hashes like its string, which is
    what the journal stores and the HTTP API shows (`door`)."""

    UDP = "udp"
    HTTP = "http"
    REDIS = "redis"


# A job id is text a person can read and put in a URL path as it is.
MAX_ID_LENGTH = 200
ID_PATTERN = r"^[A-Za-z0-9._:~@+=-]{1,200}$"
_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:~@+=-")
# What a submitter-given job id may be, as an error message says it (every door, the client).
ID_RULE = f"id must be 1 to {MAX_ID_LENGTH} of the characters A-Z a-z 0-9 and . _ : ~ @ + = -"

# Ids of this form name UDP jobs (udp-<host>-<port>-<task_id>): no other door may take one.
UDP_ID_PREFIX = "udp-"
UDP_ID_RULE = "an id starting with 'udp-' names a UDP job: give another id"

# The longest text field of a job (its name, its URLs).
MAX_TEXT = 10_000


def valid_id(job_id: str) -> bool:
    """A job id a submitter may give: 1 to 200 of the characters of ID_PATTERN."""
    return 0 < len(job_id) <= MAX_ID_LENGTH and set(job_id) <= _ID_CHARS
