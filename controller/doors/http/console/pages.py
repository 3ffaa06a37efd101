"""The console's HTML: pure functions from plain data to text, every value escaped.

Each page is whole without JavaScript: actions are forms (POST, with the CSRF token), the
overview refreshes itself with a meta refresh inside <noscript>. With JavaScript,
/ui/static/console.js draws the chart and replaces the parts marked `data-live` from a
fresh copy of the page every few seconds. No inline script or style: the pages are served
with a Content-Security-Policy that allows only our own files.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import quote

# Seconds between refreshes of a page shown without JavaScript.
REFRESH_SECONDS = 5
NAV = (
    ("/", "Overview"),
    ("/ui/jobs", "Jobs"),
    ("/ui/queues", "Queues"),
    ("/ui/workers", "Workers"),
)

e = html.escape


def job_href(job_id: str) -> str:
    return "/ui/jobs/" + quote(job_id, safe="")


def age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def hidden(name: str, value: str) -> str:
    return f'<input type=hidden name="{e(name)}" value="{e(value)}">'


def button_form(action: str, label: str, csrf: str, fields: Iterable[tuple[str, str]] = ()) -> str:
    """A one-button POST form."""
    inputs = "".join(hidden(name, value) for name, value in fields)
    return (
        f'<form class=inline method=post action="{e(action)}">{hidden("csrf", csrf)}{inputs}'
        f"<button>{e(label)}</button></form>"
    )


def layout(
    title: str,
    body: str,
    *,
    current: str = "",
    csrf: str = "",
    logout: bool = False,
    refresh: bool = False,
) -> str:
    """A whole page: head, the navigation (with a logout button when logged in), `body`."""
    links = " ".join(
        f'<a href="{href}"{" class=current" if href == current else ""}>{label}</a>'
        for href, label in NAV
    )
    out = button_form("/ui/logout", "Log out", csrf) if logout else ""
    meta = (
        f'<noscript><meta http-equiv="refresh" content="{REFRESH_SECONDS}"></noscript>'
        if refresh
        else ""
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
{meta}<title>{e(title)}</title>
<link rel="stylesheet" href="/ui/static/console.css">
<script src="/ui/static/console.js" defer></script></head>
<body><header><nav><span class=brand>Job controller</span> {links}{out}</nav></header>
<main>
{body}
</main></body></html>
"""


def table(headers: Sequence[str], rows: Sequence[str], empty: str) -> str:
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    rows_text = "\n".join(rows) or f"<tr><td colspan={len(headers)}>{e(empty)}</td></tr>"
    return f"<table><tr>{head}</tr>\n{rows_text}\n</table>"


def login_page(csrf: str, error: str = "", then: str = "/", token_file: str = "") -> str:
    """The login form; `then` is the console page to show once logged in, `token_file` the
    configured http_token_file (where an operator finds a token)."""
    problem = f"<p class=failed>{e(error)}</p>" if error else ""
    where = f" (<code>{e(token_file)}</code> on the controller's host)" if token_file else ""
    body = f"""<h1>Log in</h1>
<p>This controller asks for one of the tokens of its token file{where}.</p>{problem}
<form method=post action="/ui/login" class=login>{hidden("csrf", csrf)}{hidden("then", then)}
<label>Token <input type=password name="token" autocomplete=current-password required
autofocus></label> <button>Log in</button></form>"""
    return layout("Log in: job controller", body)


def message_page(title: str, text: str) -> str:
    return layout(title, f"<h1>{e(title)}</h1>\n<p>{e(text)}</p>")


# ---------------------------------------------------------------- workers and queues


def worker_rows(workers: Sequence[dict[str, Any]]) -> list[str]:
    """Rows of the workers table: id, kind, state, job (a link), last pulse, done, queues,
    labels."""
    rows = []
    for w in workers:
        job = w["job"]
        held = f'<a href="{job_href(job)}">{e(job)}</a>' if job else "-"
        rows.append(
            f"<tr><td class=num>{e(w['id'])}</td><td>{e(w['kind'])}</td>"
            f"<td>{e(w['state'])}</td><td>{held}</td>"
            f"<td class=num>{age(w['pulse_ago'])} ago</td><td class=num>{w['done']}</td>"
            f"<td>{e(w['queues'])}</td><td>{e(w['labels']) or '-'}</td></tr>"
        )
    return rows


WORKER_HEADERS = ("id", "kind", "state", "job", "last pulse", "done", "queues", "labels")


def workers_table(workers: Sequence[dict[str, Any]], more: int) -> str:
    rows = worker_rows(workers)
    if more > 0:
        rows.append(f"<tr><td colspan=8>and {more} more</td></tr>")
    return table(WORKER_HEADERS, rows, "no worker registered")


def queue_rows(queues: dict[str, dict[str, Any]], csrf: str | None) -> list[str]:
    """Rows of the queues table (its limits "-" when none); with `csrf`, each with its pause
    or resume button."""
    rows = []
    for name, q in queues.items():
        paused = "<b class=failed>paused</b>" if q["paused"] else "running"
        button = ""
        if csrf is not None:
            action = "/ui/queues/" + quote(name, safe="")
            label = "Resume" if q["paused"] else "Pause"
            field = ("paused", "0" if q["paused"] else "1")
            button = f"<td>{button_form(action, label, csrf, [field])}</td>"
        concurrency, rate = q.get("concurrency"), q.get("rate")
        limits = f"<td class=num>{e(str(concurrency or '-'))}</td><td>{e(str(rate or '-'))}</td>"
        filtered = "/ui/jobs?queue=" + quote(name, safe="")
        rows.append(
            f'<tr><td><a href="{e(filtered)}">{e(name)}</a></td>'
            f"<td class=num>{q['pending']}</td><td class=num>{q['scheduled']}</td>"
            f"<td class=num>{q['working']}</td><td class=num>{q['workers']}</td>"
            f"<td>{paused}</td>{limits}{button}</tr>"
        )
    return rows


def queues_page(queues: dict[str, dict[str, Any]], csrf: str, logout: bool) -> str:
    headers = ["queue", "pending", "scheduled", "working", "workers", "state"]
    headers += ["concurrency", "rate", "action"]
    body = f"""<h1>Queues</h1>
<p>A paused queue keeps taking jobs; none of them is handed out until it is resumed. A queue's
concurrency caps its jobs running at once, its rate the jobs started per second or minute
(set with <code>PUT /queue/{{name}}/</code>).</p>
<section id=queues data-live>{table(headers, queue_rows(queues, csrf), "no queue yet")}</section>
<h2>Any queue</h2>
<form method=post action="/ui/queues" class=filter>{hidden("csrf", csrf)}
<label>Queue <input name=name required pattern="[a-z0-9_.\\-]{{1,64}}"></label>
<label><input type=radio name=paused value=1 checked> pause</label>
<label><input type=radio name=paused value=0> resume</label> <button>Apply</button></form>"""
    return layout("Queues: job controller", body, current="/ui/queues", csrf=csrf, logout=logout)


def workers_page(workers: Sequence[dict[str, Any]], more: int, csrf: str, logout: bool) -> str:
    body = f"""<h1>Workers</h1>
<section id=workers data-live>{workers_table(workers, more)}</section>"""
    return layout("Workers: job controller", body, current="/ui/workers", csrf=csrf, logout=logout)


# ---------------------------------------------------------------- the overview


def redis_section(redis: dict[str, Any] | None) -> str:
    if redis is None:
        return ""
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


def rate_section(per_minute: Sequence[tuple[int, int, int]]) -> str:
    """The chart's place (drawn by the script from /ui/stats) and, for everyone, the table."""
    rows = [
        f"<tr><td>{'this minute' if ago == 0 else f'{ago} min ago'}</td>"
        f"<td class=num>{done}</td><td class=num>{failed}</td></tr>"
        for ago, done, failed in per_minute
    ]
    return f"""<h2>Jobs ended, last 10 minutes</h2>
<figure class=chart><canvas id=rate width=900 height=180 data-source="/ui/stats"
aria-label="jobs finished and failed per second"></canvas>
<figcaption><span class=finished>finished</span> and <span class=failed>failed</span> per
second</figcaption></figure>
<details id=rate-table data-live><summary>per minute</summary>
{table(["minute", "finished", "failed"], rows, "")}</details>"""


def latest_rows(jobs: Sequence[dict[str, Any]]) -> list[str]:
    rows = []
    for job in jobs:
        state = job["state"]
        rows.append(
            f'<tr><td><a href="{job_href(job["id"])}">{e(job["id"])}</a></td>'
            f"<td>{e(job['door'])}</td><td class=name>{e(job['name'])}</td>"
            f"<td>{e(job['queue'])}</td>"
            f"<td class={state}>{state}</td><td class=num>{age(job['age'])}</td>"
            f"<td class=num>{job['attempts']}</td>"
            f'<td class=err title="{e(job["error"][:1000])}">{e(job["error"][:200])}</td></tr>'
        )
    return rows


def overview_page(
    summary: dict[str, int],
    counters: Sequence[tuple[str, int]],
    redis: dict[str, Any] | None,
    workers: Sequence[dict[str, Any]],
    more_workers: int,
    queues: dict[str, dict[str, Any]],
    latest: Sequence[dict[str, Any]],
    per_minute: Sequence[tuple[int, int, int]],
    csrf: str,
    logout: bool,
) -> str:
    counter_text = "".join(f"<span>{e(name)} {value}</span>" for name, value in counters)
    latest_headers = ["id", "door", "name", "queue", "state", "age", "attempts", "error"]
    queue_headers = ["queue", "pending", "scheduled", "working", "workers", "state"]
    queue_headers += ["concurrency", "rate"]
    body = f"""<h1>Job controller</h1>
<section id=summary data-live>
<p class="summary"><span>workers: <b>{summary["workers"]}</b> ({summary["idle"]} idle)</span>
<span>queue depth (pending): <b>{summary["pending"]}</b></span>
<span>scheduled: <b>{summary["scheduled"]}</b></span>
<span>running: <b>{summary["running"]}</b></span>
<span>jobs kept: <b>{summary["kept"]}</b></span></p>
<h2>Counters</h2>
<p class="summary">{counter_text}</p>
{redis_section(redis)}</section>
{rate_section(per_minute)}
<section id=overview-queues data-live><h2>Queues</h2>
{table(queue_headers, queue_rows(queues, None), "no queue yet")}</section>
<section id=overview-workers data-live><h2>Workers</h2>
{workers_table(workers, more_workers)}</section>
<section id=latest data-live><h2>Latest jobs</h2>
{table(latest_headers, latest_rows(latest), "no job yet")}</section>
<p class=links><a href="/job/">/job/</a> · <a href="/health/">/health/</a> ·
<a href="/openapi.json">/openapi.json</a></p>"""
    title = f"job controller: {summary['workers']} workers, {summary['pending']} pending"
    return layout(title, body, current="/", csrf=csrf, logout=logout, refresh=True)
