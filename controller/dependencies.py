"""Dependencies (DESIGN.md section 17): whether the jobs a new job's option `after` names may be
waited for. Pure: every door asks before it makes a job (a refusal is its bad option); the job
desk keeps the waiting jobs themselves (controller/shell/waits.py)."""

from __future__ import annotations

from collections.abc import Mapping

from controller.jobs import JobBook


def after_refusal(
    after: tuple[str, ...],
    job_id: str,
    book: JobBook,
    index: int = 0,
    positions: Mapping[str, int] | None = None,
) -> str:
    """Why new job `job_id`, at `index` in its request, may not wait for the jobs `after` names
    ("" when it may): each must be a job the book holds, or one earlier in the same request (a
    bulk array, a batch: `positions` gives each id's index there); the job itself, or a later
    one of the request, is a cycle."""
    for named in after:
        if named == job_id:
            return f"after names the job itself ({named[:200]!r}): a cycle"
        at = positions.get(named) if positions else None
        if (at is not None and at < index) or book.get(named) is not None:
            continue
        if at is not None:
            return f"after names {named[:200]!r}, a later job of the same request: a cycle"
        return f"after names {named[:200]!r}, a job this controller does not hold"
    return ""
