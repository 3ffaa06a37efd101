"""`GET /`: the status page, server-rendered HTML that reads without JavaScript.

Workers of every kind with their state, job, last pulse, queues and labels; queue depth;
counters; the latest jobs with state and age. It refreshes itself every
2 seconds (a meta refresh). Every value from a peer or a user is escaped.
"""

from __future__ import annotations

import html
import itertools
from typing import Any

from controller.declared import shown
from controller.jobs import JobBook

REFRESH_SECONDS = 2
LATEST_JOBS = 25
MAX_WORKERS_SHOWN = 200
# Characters of a worker's queues, and of its labels, shown in its row.
NAMES_SHOWN = 120

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; margin: 0 0 .2em; } h2 { font-size: 1.1em; margin: 1.2em 0 .4em; }
table { border-collapse: collapse; } td, th { padding: .2em .8em; text-align: left; }
th { border-bottom: 1px solid #999; } tr:nth-child(even) td { background: #f3f3f3; }
.num { text-align: right; font-variant-numeric: tabular-nums; }
.pending { color: #8a6d00; } .requested, .working { color: #0b5cad; }
.finished { color: #17762d; } .failed { color: #b00020; } .canceled, .deleted { color: #777; }
.summary span { display: inline-block; margin-right: 1.5em; }
"""


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _redis_section(redis: dict[str, Any] | None) -> str:
    if redis is None:
        return ""
    e = html.escape
    link = (
        "<b>connected</b>"
        if redis["connected"]
        else f"<b class=failed>unreachable</b> ({e(str(redis['last_error'])[:200])})"
    )

    def shown(value: Any) -> str:
        return "?" if value is None else str(value)

    return f"""<h2>Redis stream</h2>
<p class="summary"><span>{link}</span>
<span>stream <b>{e(redis["stream"])}</b>, group {e(redis["group"])},
consumer {e(redis["consumer"])}</span>
<span>streams read (the queues of this controller's workers):
{e(", ".join(redis.get("streams", ())) or "none")}</span>
<span>lag (not yet read by any controller): <b>{shown(redis["lag"])}</b></span>
<span>pending (read, not yet acknowledged): <b>{shown(redis["pending"])}</b></span>
<span>held here {redis["held"]}</span><span>read {redis["read"]}</span>
<span>parked (no worker here can take them) {redis.get("parked", 0)}</span>
<span>claimed {redis["claimed"]}</span><span>skipped (ended elsewhere) {redis["skipped"]}</span>
<span>outcomes written {redis["written"]}</span></p>
"""


def render_status_page(
    core: Any,
    book: JobBook,
    now: float,
    http_counters: dict[str, int],
    refused: int,
    redis: dict[str, Any] | None = None,
) -> str:
    e = html.escape
    counters = core.counters
    workers = core.workers
    rows = []
    for worker in itertools.islice(workers.values(), MAX_WORKERS_SHOWN):
        task = worker.task
        held = e(str(task.owner)) if task is not None else "-"
        rows.append(
            f"<tr><td class=num>{e(core.worker_name(worker.worker_id))}</td>"
            f"<td>{e(worker.kind.label)}</td>"
            f"<td>{e(worker.state.value)}</td><td>{held}</td>"
            f"<td class=num>{_age(now - worker.last_pulse)} ago</td>"
            f"<td class=num>{worker.done}</td>"
            f"<td>{e(shown(worker.queues, NAMES_SHOWN))}</td>"
            f"<td>{e(shown(worker.labels, NAMES_SHOWN)) or '-'}</td></tr>"
        )
    more = len(workers) - len(rows)
    if more > 0:
        rows.append(f"<tr><td colspan=8>and {more} more</td></tr>")
    worker_rows = "\n".join(rows) or "<tr><td colspan=8>no worker registered</td></tr>"
    job_rows = []
    for job in book.latest(LATEST_JOBS):
        state = job.state.value
        job_rows.append(
            f"<tr><td>{e(job.id)}</td><td>{e(job.door)}</td><td>{e(job.name)}</td>"
            f"<td class={state}>{state}</td><td class=num>{_age(now - job.added_at)}</td>"
            f"<td class=num>{job.task.attempts if job.task is not None else job.attempts}</td>"
            f"<td>{e(job.error[:120])}</td></tr>"
        )
    latest = "\n".join(job_rows) or "<tr><td colspan=7>no job yet</td></tr>"
    running = len(core.tasks) - core.queued - core.scheduled
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{REFRESH_SECONDS}">
<title>job controller: {len(workers)} workers, {core.queued} pending</title>
<style>{_STYLE}</style></head>
<body>
<h1>Job controller</h1>
<p class="summary"><span>workers: <b>{len(workers)}</b> ({core.idle_workers} idle)</span>
<span>queue depth (pending): <b>{core.queued}</b></span>
<span>running: <b>{running}</b></span>
<span>jobs kept: <b>{len(book)}</b></span></p>
<h2>Counters</h2>
<p class="summary"><span>submitted {counters.submitted}</span>
<span>finished {counters.succeeded}</span><span>failed {counters.errors}</span>
<span>failed_post {counters.failed_post}</span><span>canceled {counters.canceled}</span>
<span>retries {counters.retries}</span><span>restarts sent {counters.restarts_sent}</span>
<span>HTTP requests {http_counters.get("requests", 0)}</span>
<span>HTTP jobs added {http_counters.get("jobs_added", 0)}</span>
<span>HTTP errors {http_counters.get("errors", 0)}</span>
<span>HTTP refused {refused}</span></p>
{_redis_section(redis)}<h2>Workers</h2>
<table><tr><th>id</th><th>kind</th><th>state</th><th>job</th><th>last pulse</th>
<th>done</th><th>queues</th><th>labels</th></tr>
{worker_rows}
</table>
<h2>Latest jobs</h2>
<table><tr><th>id</th><th>door</th><th>name</th><th>state</th><th>age</th><th>attempts</th>
<th>error</th></tr>
{latest}
</table>
<p><a href="/job/">/job/</a> · <a href="/health/">/health/</a> ·
<a href="/openapi.json">/openapi.json</a></p>
</body></html>
"""
