"""The console's job pages: the filtered list, one job, and the bulk confirmation. Pure
functions from plain data to HTML, every value escaped."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote, urlencode

from controller.doors.http.console.pages import button_form, e, job_href, layout, table

# Characters of a text payload or result shown on a job's page.
TEXT_SHOWN = 100_000
# Bytes of a binary payload or result shown in hex.
HEX_SHOWN = 64
# The fields of the job object shown on their own, below its table.
BODY_FIELDS = ("payload", "payload_b64", "result", "result_b64")
ATTEMPT_HEADERS = (
    "#",
    "worker",
    "started",
    "ended",
    "outcome",
    "error",
    "wall",
    "cpu",
    "max rss",
    "memory peak",
)


def bytes_view(data: bytes) -> str:
    """A payload or result: its text when it is UTF-8, else its size and the first bytes in
    hex."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        preview = data[:HEX_SHOWN].hex(" ")
        more = " …" if len(data) > HEX_SHOWN else ""
        return (
            f"<p>{len(data)} bytes, not UTF-8 text; the first in hex:</p>\n"
            f"<pre>{preview}{more}</pre>"
        )
    if not data:
        return "<p class=muted>empty</p>"
    cut = f"<p class=muted>the first {TEXT_SHOWN} of {len(text)} characters</p>"
    shown = text if len(text) <= TEXT_SHOWN else text[:TEXT_SHOWN]
    return f"<pre>{e(shown)}</pre>" + (cut if len(text) > TEXT_SHOWN else "")


def filter_query(state: str, queue: str, search: str, page: int = 0) -> str:
    pairs = [(k, v) for k, v in (("state", state), ("queue", queue), ("q", search)) if v]
    if page:
        pairs.append(("page", str(page)))
    return urlencode(pairs)


def _options(values: Sequence[str], chosen: str, every: str) -> str:
    out = [f'<option value=""{"" if chosen else " selected"}>{e(every)}</option>']
    for value in values:
        selected = " selected" if value == chosen else ""
        out.append(f'<option value="{e(value)}"{selected}>{e(value)}</option>')
    return "".join(out)


def jobs_page(
    jobs: Sequence[dict[str, Any]],
    *,
    states: Sequence[str],
    queues: Sequence[str],
    state: str,
    queue: str,
    search: str,
    page: int,
    has_next: bool,
    page_size: int,
    csrf: str,
    logout: bool,
) -> str:
    rows = []
    for job in jobs:
        st = job["state"]
        rows.append(
            f'<tr><td><a href="{job_href(job["id"])}">{e(job["id"])}</a></td>'
            f"<td class=name>{e(job['name'])}</td><td>{e(job['queue'])}</td>"
            f"<td class={st}>{st}</td><td>{progress_bar(job['progress'])}</td>"
            f"<td>{e(job['door'])}</td><td class=time>{e(job['added_at'])}</td>"
            f"<td class=num>{job['attempts']}</td>"
            f'<td class=err title="{e(job["error"][:1000])}">{e(job["error"][:200])}</td></tr>'
        )
    links = []
    newer = e(filter_query(state, queue, search, page - 1))
    older = e(filter_query(state, queue, search, page + 1))
    if page > 0:
        links.append(f'<a rel=prev href="/ui/jobs?{newer}">← newer</a>')
    if has_next:
        links.append(f'<a rel=next href="/ui/jobs?{older}">older →</a>')
    first = page * page_size + 1
    shown = f"jobs {first}-{first + len(jobs) - 1}" if jobs else "no job matches"
    pager = f"<p class=pager>{shown} {' '.join(links)}</p>"
    bulk = ""
    if state == "failed" and jobs:
        fields = [("state", state), ("queue", queue), ("q", search)]
        bulk = (
            "<div class=bulk>All failed jobs of this filter (at most 10,000 a time): "
            + button_form("/ui/bulk", "Retry all…", csrf, [*fields, ("action", "retry")])
            + " "
            + button_form("/ui/bulk", "Delete all…", csrf, [*fields, ("action", "delete")])
            + "</div>"
        )
    headers = ["id", "name", "queue", "state", "progress", "door", "added", "attempts", "error"]
    body = f"""<h1>Jobs</h1>
<form method=get action="/ui/jobs" class=filter>
<label>State <select name=state>{_options(states, state, "any but deleted")}</select></label>
<label>Queue <select name=queue>{_options(queues, queue, "any")}</select></label>
<label>Id or name <input type=search name=q value="{e(search)}"></label>
<button>Filter</button> <a href="/ui/jobs">clear</a></form>
{bulk}
<section id=jobs-list>{pager}
{table(headers, rows, "no job matches")}</section>"""
    return layout("Jobs: job controller", body, current="/ui/jobs", csrf=csrf, logout=logout)


def bulk_page(
    action: str,
    count: int,
    capped: bool,
    fields: Sequence[tuple[str, str]],
    csrf: str,
    logout: bool,
) -> str:
    """The confirmation of a bulk retry or delete: the count, and the form that does it."""
    verb = "Retry" if action == "retry" else "Delete"
    limit = " (the first 10,000: run it again for the rest)" if capped else ""
    back = "/ui/jobs?" + urlencode([(k, v) for k, v in fields if v])
    confirm = button_form(
        "/ui/bulk", f"{verb} {count} jobs", csrf, [*fields, ("action", action), ("confirm", "1")]
    )
    body = f"""<h1>{verb} failed jobs</h1>
<p>{count} failed jobs match this filter{limit}.</p>
<div class=actions>{confirm} <a href="{e(back)}">cancel</a></div>"""
    return layout(
        f"{verb} jobs: job controller", body, current="/ui/jobs", csrf=csrf, logout=logout
    )


def bulk_done_page(
    action: str, done: int, fields: Sequence[tuple[str, str]], csrf: str, logout: bool
) -> str:
    back = "/ui/jobs?" + urlencode([(k, v) for k, v in fields if v])
    word = "retried" if action == "retry" else "deleted"
    body = f"""<h1>Done</h1>
<p>{done} jobs {word}.</p><p><a href="{e(back)}">back to the list</a></p>"""
    return layout("Done: job controller", body, current="/ui/jobs", csrf=csrf, logout=logout)


def progress_bar(reported: tuple[float, str] | None) -> str:
    """A job's progress as a bar (an HTML <progress>: drawn without JavaScript too), its
    percentage and its status text; "" when its worker has reported none."""
    if reported is None:
        return ""
    value, status = reported
    percent = f"{value * 100:.0f}%"
    text = f" <span class=pstatus>{e(status)}</span>" if status else ""
    return (
        f'<progress class=bar max=1 value="{value:.4f}" title="{e(status)}">{percent}</progress>'
        f" <span class=num>{percent}</span>{text}"
    )


def _field(value: Any) -> str:
    if value is None:
        return "<span class=muted>null</span>"
    if isinstance(value, str):
        return e(value)
    return e(json.dumps(value, ensure_ascii=False))


def job_page(
    fields: dict[str, Any],
    payload: bytes,
    result: bytes | None,
    attempts: Sequence[dict[str, Any]],
    actions: Sequence[str],
    csrf: str,
    logout: bool,
) -> str:
    """A job: every field of its job object, payload, result, attempts, output, and the
    buttons of `actions` (cancel, retry, delete)."""
    job_id = fields["id"]
    rows = [
        f"<tr><th>{e(name)}</th><td>{_field(value)}</td></tr>"
        for name, value in fields.items()
        if name not in BODY_FIELDS
    ]
    base = job_href(job_id)
    buttons = " ".join(
        button_form(f"{base}/{action}", action.capitalize(), csrf) for action in actions
    )
    attempt_rows = [
        f"<tr><td class=num>{n}</td><td>{e(a['worker'])}</td><td class=time>{e(a['started'])}</td>"
        f"<td class=time>{e(a['ended'])}</td><td class={e(a['outcome'] or 'working')}>"
        f"{e(a['outcome'] or 'running')}</td><td>{e(a['error'])}</td>"
        f"<td class=num>{e(a.get('wall', ''))}</td><td class=num>{e(a.get('cpu', ''))}</td>"
        f"<td class=num>{e(a.get('max_rss', ''))}</td>"
        f"<td class=num>{e(a.get('memory_peak', ''))}</td></tr>"
        for n, a in enumerate(attempts, 1)
    ]
    output = "/job/" + quote(job_id, safe="") + "/output"
    result_view = (
        bytes_view(result) if result is not None else "<p class=muted>none (not finished)</p>"
    )
    state = fields["state"]
    reported = (fields["progress"], fields["status"]) if fields["progress"] is not None else None
    bar = f"<span class=progress>progress {progress_bar(reported)}</span>" if reported else ""
    body = f"""<h1>Job {e(job_id)}</h1>
<section id=job-head data-live><p class=summary>
<span>state <b class={e(state)}>{e(state)}</b></span>
<span>added {e(fields["added_at"])}</span>{_batch_link(fields.get("batch"))}{bar}</p>
{_waits_for(fields)}
<div class=actions>{buttons or "<span class=muted>no action for a deleted job</span>"}</p></section>
<h2>Fields</h2>
<section id=job-fields data-live>{table(["field", "value"], rows, "")}</section>
<h2>Attempts</h2>
<section id=job-attempts data-live>{table(ATTEMPT_HEADERS, attempt_rows, "none yet")}</section>
<h2>Payload</h2>
{bytes_view(payload) if state != "deleted" else "<p class=muted>dropped (deleted)</p>"}
<h2>Result</h2>
<section id=job-result data-live>{result_view}</section>
<h2>Output</h2>
<div class=output data-follow="{e(output)}?follow=1">
<iframe src="{e(output)}" title="output of the job"></iframe></div>"""
    return layout(
        f"Job {job_id}: job controller", body, current="/ui/jobs", csrf=csrf, logout=logout
    )


def _batch_link(batch_id: Any) -> str:
    """The link to the batch whose then job this is ("" for any other job)."""
    if not isinstance(batch_id, str) or not batch_id:
        return ""
    href = "/ui/batches/" + quote(batch_id, safe="")
    return f' <span>then job of batch <a href="{e(href)}">{e(batch_id)}</a></span>'


def _waits_for(fields: dict[str, Any]) -> str:
    """The jobs this one waits (or waited) for, as links ("" when it names none)."""
    after = fields.get("after")
    if not isinstance(after, list) or not after:
        return ""
    links = ", ".join(
        f'<a href="{e(job_href(str(job_id)))}">{e(str(job_id))}</a>' for job_id in after[:100]
    )
    outcome = "whatever their outcomes" if fields.get("after_any") else "if they all finish"
    return f"<p class=waits>runs after {links} ({outcome})</p>"
