"""`jobctl`: the operator's command over the controller's HTTP job API.

Each command is one or a few requests through the client library's blocking
`HttpPool`; what comes back is printed as a table for people, or with `--json`
as the API's own JSON, one document per command. Exit status as udp-client's:
0 success, 1 a job or command failed (the controller refused: 404, 409, 401...),
2 usage error (a 400 too: the controller found an argument bad), 3 no answer
in time or the controller unreachable. Commands on several jobs go on past a
refusal and exit with the highest status among them.
"""

from __future__ import annotations

import argparse
import io
import ipaddress
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import quote, urlsplit

from controller.cli import add_common_flags, positive_seconds, quiet_pipe
from controller.client.exit_status import EXIT_FAILED, EXIT_OK, EXIT_TIMEOUT, EXIT_USAGE
from controller.client.http import HttpPool
from controller.client.httpwire import Answer
from controller.client.jobctl_tables import job_details, jobs_table, queues_table
from controller.client.jobctl_watch import add_watch_command, run_watch
from controller.tokens import read_token

# The packaged controller's http_token_file (packaging/controller.json): read when no
# --token-file is given, the URL is on this host and the file can be read (as root).
DEFAULT_TOKEN_FILE = Path("/etc/controller/http-tokens")
# The most jobs `retry --failed` retries in one run.
MAX_BULK = 10_000
# The most jobs one listing may ask for (the API's own cap on ?limit=).
MAX_LIMIT = 1000

EPILOG = """\
examples:
  jobctl list --state failed --queue mail      the failed jobs of queue mail
  jobctl show 3F2504E0-4F89-41D3-9A0C-0305E82C3301
  jobctl retry --failed --queue mail           retry every failed job of mail
  jobctl cancel job-1 job-2                    cancel two jobs
  jobctl pause mail && jobctl resume mail      stop, then resume handing out mail's jobs
  jobctl queues --json                         the queues, as JSON for a script
  jobctl output job-1 --follow                 a job's output, as it is written
  jobctl watch --queue mail                    every change of mail's jobs, as it happens
  jobctl --url https://ctl.example:8443 --token-file /etc/controller/token list

Against this host's controller, jobctl sends the first token of
/etc/controller/http-tokens (packaging/install.sh writes it) when it can read it.

exit status: 0 success, 1 a job or command failed (unknown job, a change its
state does not allow, a refused token), 2 usage error, 3 no answer in time or
the controller unreachable.
"""


class Failed(Exception):
    """A request the controller refused or did not answer: `code` is the exit status."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message}\n")


def _limit(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"expected 1..{MAX_LIMIT}, got {text!r}")
    return int(text)


def _global_flags(parser: argparse.ArgumentParser, default: Callable[[Any], Any]) -> None:
    """The options every command takes, before or after its name (`default` is SUPPRESS
    after it, so that a value given before the command stands)."""
    parser.add_argument(
        "--url",
        metavar="URL",
        default=default("http://127.0.0.1:8080"),
        help="the controller's HTTP API, http[s]://HOST:PORT[/PREFIX/] "
        "(default http://127.0.0.1:8080); HTTPS_PROXY, HTTP_PROXY and NO_PROXY are honoured",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        default=default(None),
        help="send the bearer token in FILE with every request: its first line that is not "
        "a #-comment, read whole as the controller reads its http_token_file (default: "
        f"{DEFAULT_TOKEN_FILE} when the URL is on this host and that file can be read)",
    )
    parser.add_argument(
        "--ca-file",
        metavar="FILE",
        default=default(None),
        help="with an https --url: trust only this CA (PEM) instead of the system's trust store",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        default=default(False),
        help="print the API's JSON (one document per command) instead of a table",
    )
    parser.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=positive_seconds,
        default=default(30.0),
        help="how long to wait for each answer (default 30)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="jobctl",
        description="Look at and act on the controller's jobs and queues over its HTTP API.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_flags(parser, log_level=False)
    _global_flags(parser, lambda value: value)
    after = _Parser(add_help=False)
    _global_flags(after, lambda value: argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=summary,
            description=description,
            parents=[after],
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    listing = command(
        "list",
        "list jobs, newest first",
        "List jobs, newest first (deleted jobs only with --state deleted).",
    )
    listing.add_argument("--state", metavar="STATE", help="only jobs in STATE (e.g. failed)")
    listing.add_argument("--queue", metavar="QUEUE", help="only jobs of QUEUE")
    listing.add_argument(
        "--limit",
        metavar="N",
        type=_limit,
        default=100,
        help=f"at most N jobs (default 100, at most {MAX_LIMIT})",
    )
    show = command(
        "show", "show one job", "Show every field of one job (exit 0 whatever its state)."
    )
    show.add_argument("id", metavar="ID")
    for name, summary in (
        ("cancel", "cancel jobs (a pending one at once, a running one is stopped)"),
        ("delete", "delete jobs (their payload and result are dropped)"),
    ):
        command(name, summary, summary[0].upper() + summary[1:] + ".").add_argument(
            "ids", metavar="ID", nargs="+"
        )
    retry = command(
        "retry",
        "put failed or canceled jobs back to pending",
        "Put failed or canceled jobs back to pending, with a fresh max_retries: the jobs "
        f"named, or with --failed every failed job (of --queue), at most {MAX_BULK:,} a run.",
    )
    retry.add_argument("ids", metavar="ID", nargs="*")
    retry.add_argument(
        "--failed", action="store_true", help="retry every failed job (the count is said first)"
    )
    retry.add_argument("--queue", metavar="QUEUE", help="with --failed: only the jobs of QUEUE")
    for name, summary in (
        ("pause", "stop handing out a queue's jobs (submission goes on)"),
        ("resume", "hand out a paused queue's jobs again"),
    ):
        command(name, summary, summary[0].upper() + summary[1:] + ".").add_argument(
            "queue", metavar="QUEUE"
        )
    command(
        "queues",
        "show every queue's jobs, workers, pause and limits",
        "Show every queue that has jobs, workers, a pause or a limit (concurrency, rate).",
    )
    output = command(
        "output",
        "print a job's output (what it wrote to stderr)",
        "Print what a job wrote to stderr, as the controller keeps it (the newest "
        "output_retention bytes); --json has no effect: the output is text.",
    )
    output.add_argument("id", metavar="ID")
    output.add_argument(
        "--follow",
        action="store_true",
        help="go on printing what the job writes until it ends",
    )
    add_watch_command(command)
    return parser


# ---------------------------------------------------------------- talking to the controller


def _job_path(job_id: str, tail: str = "") -> str:
    return f"/job/{quote(job_id, safe='')}/{tail}"


def _message(answer: Answer) -> str:
    """The API's error message, or the start of whatever the answer says."""
    try:
        data = answer.json()
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("message"), str):
        return str(data["message"])
    return answer.text.strip()[:200] or "(no message)"


def on_this_host(url: str) -> bool:
    """Whether `url` names this host: localhost or a loopback address (the default token
    file is this host's controller's, never sent elsewhere)."""
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return False
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_token(url: str) -> str | None:
    """The token of DEFAULT_TOKEN_FILE for a URL on this host, when that file can be read;
    else None (a file there that holds no usable token raises ValueError)."""
    if not on_this_host(url) or not os.access(DEFAULT_TOKEN_FILE, os.R_OK):
        return None
    return read_token(DEFAULT_TOKEN_FILE)


def _refusal(status: int, message: str, what: str) -> Failed:
    hint = ""
    if status == 401 and os.access(DEFAULT_TOKEN_FILE, os.R_OK):
        hint = " (give --token-file)"
    elif status == 401:  # the packaged token file is root's alone
        hint = f" (give --token-file, or run as root for {DEFAULT_TOKEN_FILE})"
    code = EXIT_USAGE if status == 400 else EXIT_FAILED
    return Failed(code, f"{what}: {status} {message}{hint}")


class Api:
    """Requests to the controller; a refusal or no answer raises Failed."""

    def __init__(self, pool: HttpPool) -> None:
        self.pool = pool

    def call(
        self,
        method: str,
        path: str,
        what: str,
        *,
        body: Any = None,
        query: dict[str, Any] | None = None,
    ) -> Any:
        try:
            answer = self.pool.request(method, path, json=body, query=query)
        except OSError as exc:  # TimeoutError, ConnectionError: no answer
            raise Failed(EXIT_TIMEOUT, f"{what}: {exc}") from None
        if answer.status >= 400:
            raise _refusal(answer.status, _message(answer), what)
        try:
            return answer.json()
        except ValueError:
            raise Failed(EXIT_FAILED, f"{what}: not a JSON answer: {answer.text[:200]!r}") from None


# ---------------------------------------------------------------- commands


def _print_json(document: Any) -> None:
    print(json.dumps(document, indent=2, ensure_ascii=False))


def _warn(message: str) -> None:
    print(f"jobctl: {message}", file=sys.stderr, flush=True)


def run_list(api: Api, args: argparse.Namespace) -> int:
    query: dict[str, Any] = {"limit": args.limit}
    if args.state:
        query["state"] = args.state
    if args.queue:
        query["queue"] = args.queue
    listing = api.call("GET", "/job/", "list", query=query)
    if args.json:
        _print_json(listing)
    elif listing:
        print(jobs_table(listing.values()))
    else:
        _warn("no jobs")
    return EXIT_OK


def run_show(api: Api, args: argparse.Namespace) -> int:
    job = api.call("GET", _job_path(args.id), f"show {args.id}")
    if args.json:
        _print_json(job)
    else:
        print(job_details(job))
    return EXIT_OK


def _each(
    api: Api,
    args: argparse.Namespace,
    ids: list[str],
    act: Callable[[str], tuple[str, str, Any]],
) -> int:
    """Act on each job; the ones done in one table (or JSON object keyed by id), a line on
    stderr for each refusal; the highest exit status among them."""
    done: dict[str, Any] = {}
    code = EXIT_OK
    for job_id in dict.fromkeys(ids):
        method, path, body = act(job_id)
        try:
            done[job_id] = api.call(method, path, f"{args.command} {job_id}", body=body)
        except Failed as exc:
            _warn(str(exc))
            code = max(code, exc.code)
            if exc.code == EXIT_TIMEOUT:
                break  # the controller is gone: the rest would wait as long each
    if args.json:
        _print_json(done)
    elif done:
        print(jobs_table(done.values()))
    return code


def run_cancel(api: Api, args: argparse.Namespace) -> int:
    return _each(api, args, args.ids, lambda i: ("PUT", _job_path(i), {"state": "canceled"}))


def run_delete(api: Api, args: argparse.Namespace) -> int:
    return _each(api, args, args.ids, lambda i: ("DELETE", _job_path(i), None))


def run_retry(api: Api, args: argparse.Namespace) -> int:
    if not args.failed:
        return _each(api, args, args.ids, lambda i: ("POST", _job_path(i, "retry/"), None))
    # The listing holds at most MAX_LIMIT jobs: list again after each batch (the retried ones
    # are failed no more), until no new failed job shows or MAX_BULK are done. A job that
    # fails again meanwhile is not retried twice in one run.
    seen: set[str] = set()
    done: dict[str, Any] = {}
    code = EXIT_OK
    where = f" of queue {args.queue}" if args.queue else ""
    while len(seen) < MAX_BULK:
        query: dict[str, Any] = {"state": "failed", "limit": MAX_LIMIT}
        if args.queue:
            query["queue"] = args.queue
        listing = api.call("GET", "/job/", "retry --failed: list", query=query)
        batch = [job_id for job_id in listing if job_id not in seen][: MAX_BULK - len(seen)]
        if not batch:
            break
        more = " (more may follow)" if len(listing) >= MAX_LIMIT else ""
        _warn(f"retrying {len(batch)} failed job(s){where}{more}")
        for job_id in batch:
            seen.add(job_id)
            try:
                path = _job_path(job_id, "retry/")
                done[job_id] = api.call("POST", path, f"retry {job_id}")
            except Failed as exc:
                _warn(str(exc))
                code = max(code, exc.code)
                if exc.code == EXIT_TIMEOUT:
                    return code
        if len(listing) < MAX_LIMIT:
            break
    if not seen:
        _warn(f"no failed jobs{where}")
    elif len(seen) >= MAX_BULK:
        _warn(f"stopped at {MAX_BULK:,} jobs: run it again for more")
    if args.json:
        _print_json(done)
    elif done:
        print(jobs_table(done.values()))
    return code


def _pause(api: Api, args: argparse.Namespace, paused: bool) -> int:
    path = f"/queue/{quote(args.queue, safe='')}/"
    report = api.call("PUT", path, f"{args.command} {args.queue}", body={"paused": paused})
    if args.json:
        _print_json(report)
    else:
        print(queues_table(report))
    return EXIT_OK


def run_pause(api: Api, args: argparse.Namespace) -> int:
    return _pause(api, args, True)


def run_resume(api: Api, args: argparse.Namespace) -> int:
    return _pause(api, args, False)


def run_queues(api: Api, args: argparse.Namespace) -> int:
    report = api.call("GET", "/queue/", "queues")
    if args.json:
        _print_json(report)
    elif report:
        print(queues_table(report))
    else:
        _warn("no queues: no jobs, no workers, no pause and no limit")
    return EXIT_OK


def run_output(api: Api, args: argparse.Namespace) -> int:
    what = f"output {args.id}"
    query = {"follow": "1"} if args.follow else None
    out = sys.stdout.buffer
    try:
        with api.pool.stream("GET", _job_path(args.id, "output"), query=query) as answer:
            if answer.status >= 400:
                raise _refusal(answer.status, _message(Answer(answer.status, answer.read())), what)
            for piece in answer:
                out.write(piece)
                out.flush()
    except OSError as exc:  # TimeoutError, ConnectionError: no answer, or cut short
        raise Failed(EXIT_TIMEOUT, f"{what}: {exc}") from None
    return EXIT_OK


COMMANDS: dict[str, Callable[[Api, argparse.Namespace], int]] = {
    "list": run_list,
    "show": run_show,
    "cancel": run_cancel,
    "retry": run_retry,
    "delete": run_delete,
    "pause": run_pause,
    "resume": run_resume,
    "queues": run_queues,
    "output": run_output,
    "watch": lambda api, args: run_watch(api, args, _refusal, _message),
}


def main(argv: list[str] | None = None) -> int:
    try:
        return quiet_pipe(_main, argv)  # `jobctl list | head`
    except KeyboardInterrupt:
        return 130


def _main(argv: list[str] | None) -> int:
    # A name or payload may hold a lone surrogate (JSON allows "\udc80"): printed as that
    # escape, which is still valid JSON, instead of failing.
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "retry":
        if args.failed and args.ids:
            parser.exit(EXIT_USAGE, "jobctl retry: give job ids or --failed, not both\n")
        if not args.failed and not args.ids:
            parser.exit(EXIT_USAGE, "jobctl retry: give job ids, or --failed\n")
        if args.queue and not args.failed:
            parser.exit(EXIT_USAGE, "jobctl retry: --queue goes with --failed\n")
    try:
        token = read_token(Path(args.token_file)) if args.token_file else default_token(args.url)
    except ValueError as exc:
        _warn(f"--token-file {exc}" if args.token_file else f"{exc} (give --token-file)")
        return EXIT_USAGE
    try:
        pool = HttpPool(args.url, token=token, timeout=args.timeout, ca_file=args.ca_file)
    except ValueError as exc:
        _warn(str(exc))
        return EXIT_USAGE
    try:
        return COMMANDS[args.command](Api(pool), args)
    except Failed as exc:
        _warn(str(exc))
        return exc.code
    finally:
        pool.close()


if __name__ == "__main__":
    sys.exit(main())
