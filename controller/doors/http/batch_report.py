"""A batch's report (`GET /batch/{id}/` and the console's batch page): its jobs counted by
state, their ids and its `then` job's id, read from the job book."""

from __future__ import annotations

from typing import Any

from controller.doors.http.codec import ApiError
from controller.jobs import JobBook


def report_of(book: JobBook, batches: dict[str, str], batch_id: str) -> dict[str, Any]:
    """Batch `batch_id`'s report (ApiError 404 when none is known)."""
    then = book.get(batches.get(batch_id, ""))
    if then is None or then.options.batch != batch_id:
        batches.pop(batch_id, None)  # its `then` job was forgotten: so is the batch
        raise ApiError(404, f"no batch {batch_id[:200]!r}")
    ids = list(then.options.after)
    counts: dict[str, int] = {}
    for job_id in ids:
        job = book.get(job_id)
        if job is not None:
            state = job.state.value
            counts[state] = counts.get(state, 0) + 1
    return {"id": batch_id, "counts": counts, "ids": ids, "then": then.id}
