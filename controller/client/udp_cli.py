"""`udp-client`: submit jobs to the controller's UDP front door and wait for their outcome.

Exit status: 0 success, 1 task error or failed_post (or refused), 2 usage
error, 3 no answer in time; with many tasks, the highest among them.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import signal
import socket as stdsocket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio

from controller import datagram as dg
from controller.cli import add_common_flags, quiet_pipe
from controller.client.exit_status import EXIT_FAILED, EXIT_OK, EXIT_TIMEOUT, EXIT_USAGE
from controller.client.jobfields import add_cli_options, cli_fields
from controller.client.udp_engine import Outcome, UdpSession
from controller.client.udp_output import Progress, format_status, outcome_json, summary


class UsageError(Exception):
    pass


def parse_server(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def parse_ids(spec: str | None, ids_from: str | None) -> list[int]:
    if (spec is None) == (ids_from is None):
        raise UsageError("give TASK_ID (or FIRST-LAST) or --ids-from FILE, not both")
    if ids_from is not None:
        try:
            lines = Path(ids_from).read_text().splitlines()
        except OSError as exc:
            raise UsageError(f"--ids-from {ids_from}: {exc.strerror}") from None
        ids = []
        for number, line in enumerate(lines, 1):
            if line.strip():
                ids.append(_task_id(line.strip(), f"{ids_from} line {number}"))
        if not ids:
            raise UsageError(f"--ids-from {ids_from}: no task ids in the file")
        return ids
    assert spec is not None
    first, sep, last = spec.partition("-")
    if sep:
        low, high = _task_id(first, "range start"), _task_id(last, "range end")
        if high < low:
            raise UsageError(f"empty range {spec}")
        return list(range(low, high + 1))
    return [_task_id(spec, "TASK_ID")]


def _task_id(text: str, what: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"{what}: expected a task id (a whole number >= 1), got {text!r}")
    return int(text)


# How long each address of a name with several (localhost: ::1 and 127.0.0.1) is tried.
PROBE_TIMEOUT = 0.3


def resolve(server: tuple[str, int]) -> tuple[int, tuple[str, int]]:
    """Resolve the server once, so that sending never does a name lookup. When the name has
    several addresses, the first that answers is used: `localhost` works whichever family
    it resolves to first and whichever the controller listens on."""
    try:
        infos = stdsocket.getaddrinfo(server[0], server[1], type=stdsocket.SOCK_DGRAM)
    except OSError as exc:
        raise UsageError(f"--server {server[0]}:{server[1]}: {exc}") from None
    candidates = list(
        dict.fromkeys((family, (str(addr[0]), int(addr[1]))) for family, _, _, _, addr in infos)
    )
    if len(candidates) > 1:
        for family, address in candidates:
            if _answers(family, address):
                return family, address
    return candidates[0]


def _answers(family: int, address: tuple[str, int]) -> bool:
    """Does a controller answer on `address`? A get_task for a job nobody has: even its
    error acknowledgement says yes (padded, so that the answer is not withheld)."""
    probe = dg.request("get_task", {"task_id": 1, "pad": "x" * 120}, 1)
    with stdsocket.socket(family, stdsocket.SOCK_DGRAM) as sock:
        sock.settimeout(PROBE_TIMEOUT)
        try:
            sock.sendto(probe, address)
            sock.recv(dg.MAX_DATAGRAM)
        except OSError:  # refused (ICMP), unreachable, or silent: not there
            return False
    return True


@contextlib.contextmanager
def session(args: argparse.Namespace) -> Iterator[UdpSession]:
    """A UDP session with --server (resolved once) on a socket of its own, closed at the end."""
    family, server = resolve(args.server)
    with stdsocket.socket(family, stdsocket.SOCK_DGRAM) as sock:
        sock.bind(("::" if family == stdsocket.AF_INET6 else "0.0.0.0", 0))
        yield UdpSession(sock, server, args.timeout)


def local_address(family: int, server: tuple[str, int], port: int) -> tuple[str, int]:
    """The address the controller sees us at (a UDP job's id is built from it)."""
    with stdsocket.socket(family, stdsocket.SOCK_DGRAM) as probe:
        try:
            probe.connect(server)
            return str(probe.getsockname()[0]), port
        except OSError:
            return "?", port


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="udp-client",
        description="Submit jobs to the controller's UDP front door and print their results.",
        epilog="Exit status: 0 success, 1 task error or failed_post, 2 usage error, "
        "3 no answer in time.",
    )
    add_common_flags(parser, log_level=False)
    parser.add_argument(
        "--server",
        metavar="HOST:PORT",
        type=parse_server,
        default=("127.0.0.1", 5555),
        help="front door address (default 127.0.0.1:5555)",
    )
    parser.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=float,
        default=60.0,
        help="how long to wait for each task's outcome (default 60)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add = sub.add_parser(
        "add",
        help="submit task(s) and wait for the outcome",
        description="Submit TASK_ID (or every id of FIRST-LAST) and wait for its outcome; "
        "one task prints its result on stdout.",
    )
    add.add_argument("task_id", nargs="?", metavar="TASK_ID|FIRST-LAST")
    add.add_argument(
        "--ids-from", metavar="FILE", help="submit the task ids listed in FILE, one per line"
    )
    group = add.add_mutually_exclusive_group()
    group.add_argument("--payload", metavar="TEXT", help="the job's input as text")
    group.add_argument(
        "--payload-file", metavar="FILE", help="the job's input, read from FILE as bytes"
    )
    add.add_argument(
        "--json",
        action="store_true",
        help="print one JSON line per job as it ends (id, task_id, status, result or error)",
    )
    add.add_argument(
        "--window",
        type=int,
        default=64,
        metavar="N",
        help="tasks in flight at once when submitting many (default 64)",
    )
    status = sub.add_parser(
        "status",
        help="show live workers and task counts",
        description="Ask the controller for its live workers and task counts "
        "(allowed clients only).",
    )
    status.add_argument("--json", action="store_true", help="print the raw report as JSON")
    add_cli_options(add)
    # The global options are accepted after the command too (`udp-client add 5 --server H:P`),
    # but for add's own --timeout: the job's (before `add`, it is how long to wait).
    for command in (add, status):
        command.add_argument(
            "--server", type=parse_server, default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    status.add_argument("--timeout", type=float, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def _payload(args: argparse.Namespace) -> dict[str, Any]:
    """What every add_task carries besides its task_id: the payload and the job options."""
    return {**_payload_only(args), **cli_fields(args)}


def _payload_only(args: argparse.Namespace) -> dict[str, Any]:
    if args.payload is not None:
        return {"payload": args.payload}
    if args.payload_file is not None:
        try:
            data = Path(args.payload_file).read_bytes()
        except OSError as exc:
            raise UsageError(f"--payload-file {args.payload_file}: {exc.strerror}") from None
        try:
            return {"payload": data.decode("utf-8")}
        except UnicodeDecodeError:
            return {"payload_b64": base64.b64encode(data).decode()}
    return {}


async def run_add(args: argparse.Namespace, ids: list[int], payload: dict[str, Any]) -> int:
    with session(args) as client:
        host, port = local_address(client.sock.family, client.server, client.sock.getsockname()[1])
        outcomes: list[Outcome] = []
        progress = Progress(len(ids)) if len(ids) > 1 and not args.json else None
        started = time.monotonic()
        interrupted = False

        def done(outcome: Outcome) -> None:
            outcomes.append(outcome)
            if progress is not None:
                progress.step(outcome.status == "success")
            if args.json:
                print(outcome_json(outcome, f"udp-{host}-{port}-{outcome.task_id}"), flush=True)

        async def on_ctrl_c(scope: trio.CancelScope) -> None:
            nonlocal interrupted
            with trio.open_signal_receiver(signal.SIGINT) as signals:
                async for _ in signals:
                    interrupted = True
                    scope.cancel()
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.receive)
            nursery.start_soon(on_ctrl_c, nursery.cancel_scope)
            await client.run_many(ids, payload, min(args.window, len(ids)), done)
            nursery.cancel_scope.cancel()
    if progress is not None:
        progress.finish()
    if interrupted:
        print(
            f"udp-client: interrupted after {len(outcomes)} of {len(ids)} tasks",
            file=sys.stderr,
        )
        if outcomes and not args.json:
            elapsed = time.monotonic() - started
            print(summary(outcomes, client.duplicates, elapsed), file=sys.stderr)
        return 130
    if args.json:
        return max(o.exit_code for o in outcomes)
    if progress is None and len(outcomes) == 1:
        [outcome] = outcomes
        if outcome.status == "success":
            sys.stdout.buffer.write(outcome.result)
            sys.stdout.flush()
        elif outcome.status == "timeout":
            print(
                f"udp-client: task {outcome.task_id}: no answer from "
                f"{args.server[0]}:{args.server[1]} within {args.timeout:g} s ({outcome.error})",
                file=sys.stderr,
            )
        else:
            print(
                f"udp-client: task {outcome.task_id}: {outcome.status}: {outcome.error}",
                file=sys.stderr,
            )
        return outcome.exit_code
    print(summary(outcomes, client.duplicates, time.monotonic() - started), file=sys.stderr)
    for outcome in sorted(outcomes, key=lambda o: o.task_id):
        if outcome.status != "success":
            print(f"task {outcome.task_id}: {outcome.status}: {outcome.error}", file=sys.stderr)
    return max(o.exit_code for o in outcomes)


async def run_status(args: argparse.Namespace) -> int:
    with session(args) as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.receive)
            ack = await client.request("status", {}, trio.current_time() + args.timeout)
            nursery.cancel_scope.cancel()
    if ack is None:
        print(f"udp-client: no answer from {args.server[0]}:{args.server[1]}", file=sys.stderr)
        return EXIT_TIMEOUT
    if "error" in ack:
        print(f"udp-client: status refused: {ack['error']}", file=sys.stderr)
        return EXIT_FAILED
    report = ack.get("params", {})
    print(json.dumps(report, indent=2) if args.json else format_status(report))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    return quiet_pipe(_main, argv)  # `udp-client status | head`


def _main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "status":
        try:
            return trio.run(run_status, args)
        except UsageError as exc:
            print(f"udp-client: {exc}", file=sys.stderr)
            return EXIT_USAGE
    try:
        ids = parse_ids(args.task_id, args.ids_from)
        payload = _payload(args)
        if not args.timeout > 0:
            raise UsageError("--timeout must be more than 0")
    except UsageError as exc:
        print(f"udp-client: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return trio.run(run_add, args, ids, payload)
    except UsageError as exc:
        print(f"udp-client: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
