"""The console's page of a batch (`POST /batch/`): its jobs counted by state, its `then` job,
and its jobs with their states. Pure, like pages.py: plain data in, escaped HTML out."""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import quote

from controller.doors.http.console.pages import e, job_href, layout, table

# Jobs listed on a batch's page at most (the counts cover them all).
MAX_LISTED = 1000


def batch_href(batch_id: str) -> str:
    return "/ui/batches/" + quote(batch_id, safe="")


def batch_page(
    report: dict[str, object],
    jobs: Sequence[tuple[str, str, str]],
    then_state: str,
    csrf: str,
    logout: bool,
) -> str:
    """Batch `report` (GET /batch/{id}/'s answer), its jobs as (id, state, queue), at most
    MAX_LISTED of them, and its `then` job's state."""
    batch_id = str(report["id"])
    then_id = str(report["then"])
    counts = report["counts"]
    assert isinstance(counts, dict)
    ids = report["ids"]
    assert isinstance(ids, list)
    count_rows = [
        f"<tr><td class={e(state)}>{e(state)}</td><td class=num>{n}</td></tr>"
        for state, n in sorted(counts.items())
    ]
    job_rows = [
        f'<tr><td><a href="{e(job_href(job_id))}">{e(job_id)}</a></td>'
        f"<td class={e(state)}>{e(state)}</td><td>{e(queue)}</td></tr>"
        for job_id, state, queue in jobs
    ]
    more = len(ids) - len(jobs)
    shown_more = f"<p class=muted>and {more} more</p>" if more > 0 else ""
    body = f"""<h1>Batch {e(batch_id)}</h1>
<section id=batch-head data-live><p class=summary>
<span>{len(ids)} jobs</span>
<span>then <a href="{e(job_href(then_id))}">{e(then_id)}</a>
<b class={e(then_state)}>{e(then_state)}</b></span></p>
<p class=muted>The then job runs once every job of the batch has ended, whatever their
outcomes.</p></section>
<h2>Counts</h2>
<section id=batch-counts data-live>{table(["state", "jobs"], count_rows, "no job kept")}</section>
<h2>Jobs</h2>
<section id=batch-jobs data-live>{table(["id", "state", "queue"], job_rows, "none")}
{shown_more}</section>"""
    return layout(
        f"Batch {batch_id}: job controller", body, current="/ui/jobs", csrf=csrf, logout=logout
    )
