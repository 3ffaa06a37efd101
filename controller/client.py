"""`udp-client`: submit jobs to the controller's UDP front door and wait for their outcome.

One UDP socket; a receiver task routes acknowledgements to the request that
waits for them (by transmission_id) and notifications to the task that waits
for them (by task_id), acknowledging every copy and reporting each outcome
once. Requests are repeated with a doubling interval until acknowledged. A
task whose notification seems lost is asked about with get_task; a result too
large for one datagram is read with get_result.

Exit status: 0 success, 1 task error or failed_post (or refused), 2 usage
error, 3 no answer in time; with many tasks, the highest among them.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import itertools
import json
import math
import os
import socket as stdsocket
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT = 0, 1, 2, 3
# First repeat of an unacknowledged request, then doubling up to the cap.
RESEND_FIRST = 0.2
RESEND_MAX = 2.0
# With no notification this long after the acknowledgement, ask with get_task (then again).
POLL_AFTER = 3.0
CHUNK = 32_768
# Datagrams handled in a row before the receiver lets the tasks it woke run.
RECEIVE_BURST = 64


class UsageError(Exception):
    pass


@dataclass
class Outcome:
    task_id: int
    status: str  # success, error, failed_post, refused, timeout
    result: bytes = b""
    error: str = ""
    latency: float = 0.0

    @property
    def exit_code(self) -> int:
        if self.status == "success":
            return EXIT_OK
        return EXIT_TIMEOUT if self.status == "timeout" else EXIT_FAILED


@dataclass
class _Waiter:
    event: trio.Event = field(default_factory=trio.Event)
    packet: dict[str, Any] | None = None


class Client:
    """Runs tasks through one bound UDP socket; `receive()` must run beside `run_task`.

    The socket is a plain stdlib socket used without blocking: sending never
    waits (a datagram the kernel cannot take is lost, and repeated like any
    other), and `receive` drains every datagram that is there before it waits.
    """

    def __init__(self, sock: stdsocket.socket, server: tuple[str, int], timeout: float) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.server = server
        self.timeout = timeout
        self.duplicates = 0
        self._txid = itertools.count(int(time.time() * 1000))
        self._acks: dict[int, _Waiter] = {}
        self._notes: dict[int, _Waiter] = {}

    async def receive(self) -> None:
        sock = self.sock
        burst = 0
        while True:
            try:
                data = sock.recv(65_535)
            except BlockingIOError:
                burst = 0
                await trio.lowlevel.wait_readable(sock)
                continue
            except OSError:
                continue  # an ICMP error from an earlier send: the repeats deal with it
            burst += 1
            if burst % RECEIVE_BURST == 0:
                await trio.lowlevel.checkpoint()  # let the waiting tasks run
            try:
                packet = json.loads(data)
            except ValueError:
                continue
            if not isinstance(packet, dict):
                continue
            if packet.get("packet_type") == 2:
                waiter = self._acks.get(packet.get("transmission_id"))  # type: ignore[arg-type]
                if waiter is not None and not waiter.event.is_set():
                    waiter.packet = packet
                    waiter.event.set()
            elif packet.get("method") == "notify_task":
                self._on_notify(packet)

    def _send(self, data: bytes) -> None:
        # A datagram the kernel refuses (full buffer, unreachable) is lost like any
        # other: requests are repeated, and a lost ack brings the notification again.
        with contextlib.suppress(OSError):
            self.sock.sendto(data, self.server)

    def _on_notify(self, packet: dict[str, Any]) -> None:
        txid = packet.get("transmission_id")
        if packet.get("packet_type") == 1 and isinstance(txid, int):
            ack = {"method": "ack", "packet_type": 2, "transmission_id": txid}
            self._send(json.dumps(ack).encode())
        params = packet.get("params")
        if not isinstance(params, dict):
            return
        task_id = params.get("task_id")
        waiter = self._notes.get(task_id) if isinstance(task_id, int) else None
        if waiter is None or waiter.event.is_set():
            self.duplicates += 1  # a repeat of an outcome already reported
            return
        waiter.packet = params
        waiter.event.set()

    async def request(
        self, method: str, params: dict[str, Any], deadline: float
    ) -> dict[str, Any] | None:
        """Send until acknowledged; the acknowledgement, or None at the deadline."""
        txid = next(self._txid)
        data = json.dumps(
            {"method": method, "params": params, "packet_type": 1, "transmission_id": txid}
        ).encode()
        waiter = _Waiter()
        self._acks[txid] = waiter
        interval = RESEND_FIRST
        try:
            while trio.current_time() < deadline:
                self._send(data)
                with trio.move_on_at(min(deadline, trio.current_time() + interval)):
                    await waiter.event.wait()
                    return waiter.packet
                interval = min(interval * 2, RESEND_MAX)
            return None
        finally:
            del self._acks[txid]

    async def run_task(self, task_id: int, payload: dict[str, Any]) -> Outcome:
        start = trio.current_time()
        deadline = start + self.timeout
        waiter = _Waiter()
        self._notes[task_id] = waiter
        try:
            ack = await self.request("add_task", {"task_id": task_id, **payload}, deadline)
            if ack is None:
                return Outcome(task_id, "timeout", error="add_task was not acknowledged")
            if "error" in ack:
                err = ack["error"]
                return Outcome(
                    task_id, "refused", error=f"{err.get('code')}: {err.get('message', '')}"
                )
            params = await self._await_outcome(task_id, waiter, deadline)
            if params is None:
                return Outcome(task_id, "timeout", error="no notification in time")
            outcome = await self._outcome(task_id, params, deadline)
            outcome.latency = trio.current_time() - start
            return outcome
        finally:
            self._notes.pop(task_id, None)

    async def run_many(
        self,
        task_ids: Iterable[int],
        payload: dict[str, Any],
        window: int,
        on_outcome: Callable[[Outcome], None],
    ) -> None:
        """Run every task, `window` at a time, reporting each outcome as it comes.

        A fixed set of `window` runners takes the ids in turn: no task and no
        limiter per id.
        """
        ids = iter(task_ids)

        async def runner() -> None:
            for task_id in ids:
                on_outcome(await self.run_task(task_id, payload))

        async with trio.open_nursery() as nursery:
            for _ in range(max(1, window)):
                nursery.start_soon(runner)

    async def _await_outcome(
        self, task_id: int, waiter: _Waiter, deadline: float
    ) -> dict[str, Any] | None:
        while True:
            with trio.move_on_at(min(deadline, trio.current_time() + POLL_AFTER)):
                await waiter.event.wait()
                return waiter.packet
            if trio.current_time() >= deadline:
                return None
            ack = await self.request("get_task", {"task_id": task_id}, deadline)
            if ack is None:
                return None
            params = ack.get("params") or {}
            if params.get("status") in ("success", "error", "failed_post"):
                if waiter.event.is_set():
                    return waiter.packet
                waiter.event.set()  # from now on a late notification counts as a duplicate
                return dict(params)

    async def _outcome(self, task_id: int, params: dict[str, Any], deadline: float) -> Outcome:
        status = params.get("status")
        if status != "success":
            return Outcome(task_id, str(status), error=str(params.get("error", "")))
        if "result" in params:
            return Outcome(task_id, "success", str(params["result"]).encode("utf-8"))
        if "result_b64" in params:
            return Outcome(task_id, "success", base64.b64decode(params["result_b64"]))
        size = params.get("result_size", 0)
        result = bytearray()
        while len(result) < size:
            ack = await self.request(
                "get_result", {"task_id": task_id, "offset": len(result), "length": CHUNK}, deadline
            )
            if ack is None or "error" in ack:
                return Outcome(task_id, "timeout", error="could not read the result")
            chunk = base64.b64decode(ack["params"]["result_b64"])
            if not chunk:
                break
            result += chunk
        return Outcome(task_id, "success", bytes(result))


# ---------------------------------------------------------------- command line


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


def resolve(server: tuple[str, int]) -> tuple[int, tuple[str, int]]:
    """Resolve the server once, so that sending never does a name lookup."""
    try:
        infos = stdsocket.getaddrinfo(server[0], server[1], type=stdsocket.SOCK_DGRAM)
    except OSError as exc:
        raise UsageError(f"--server {server[0]}:{server[1]}: {exc}") from None
    family, _, _, _, sockaddr = infos[0]
    return family, (str(sockaddr[0]), int(sockaddr[1]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="udp-client",
        description="Submit jobs to the controller's UDP front door and print their results.",
        epilog="Exit status: 0 success, 1 task error or failed_post, 2 usage error, "
        "3 no answer in time.",
    )
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
    # The global options are accepted after the command too (`udp-client add 5 --server H:P`).
    for command in (add, status):
        command.add_argument(
            "--server", type=parse_server, default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
        command.add_argument(
            "--timeout", type=float, default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    return parser


def _payload(args: argparse.Namespace) -> dict[str, Any]:
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


class Progress:
    """A progress line on a terminal, a plain line every few seconds elsewhere."""

    def __init__(self, total: int, stream: Any = sys.stderr) -> None:
        self.total = total
        self.done = 0
        self.failed = 0
        self.stream = stream
        self.tty = stream.isatty()
        self.start = time.monotonic()
        self._last = 0.0

    def step(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = time.monotonic()
        if now - self._last < (0.1 if self.tty else 5.0) and self.done < self.total:
            return
        self._last = now
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate else math.inf
        if self.tty:
            width = 30
            filled = width * self.done // self.total
            bar = "#" * filled + "-" * (width - filled)
            print(
                f"\r[{bar}] {self.done}/{self.total} {rate:,.0f}/s "
                f"ETA {eta:,.0f}s failed {self.failed}",
                end="",
                file=self.stream,
                flush=True,
            )
            if self.done == self.total:
                print(file=self.stream)
        else:
            print(
                f"progress: {self.done}/{self.total} done, {rate:,.0f}/s, "
                f"ETA {eta:,.0f} s, {self.failed} failed",
                file=self.stream,
                flush=True,
            )


def summary(outcomes: list[Outcome], duplicates: int, elapsed: float) -> str:
    counts = {status: 0 for status in ("success", "error", "failed_post", "refused", "timeout")}
    for outcome in outcomes:
        counts[outcome.status] = counts.get(outcome.status, 0) + 1
    latencies = sorted(o.latency for o in outcomes if o.status == "success")
    lines = [
        f"tasks: {len(outcomes)} in {elapsed:.2f} s ({len(outcomes) / max(elapsed, 1e-9):,.0f}/s)",
        f"succeeded: {counts['success']}  failed: {counts['error']}"
        f"  failed_post: {counts['failed_post']}  refused: {counts['refused']}"
        f"  no answer: {counts['timeout']}",
        f"duplicates suppressed: {duplicates}",
    ]
    if latencies:
        p50 = statistics.median(latencies)
        p99 = latencies[min(len(latencies) - 1, math.ceil(0.99 * len(latencies)) - 1)]
        lines.append(f"latency p50 {p50 * 1000:.2f} ms  p99 {p99 * 1000:.2f} ms")
    return "\n".join(lines)


async def run_add(args: argparse.Namespace, ids: list[int], payload: dict[str, Any]) -> int:
    family, server = resolve(args.server)
    with stdsocket.socket(family, stdsocket.SOCK_DGRAM) as sock:
        sock.bind(("::" if family == stdsocket.AF_INET6 else "0.0.0.0", 0))
        client = Client(sock, server, args.timeout)
        outcomes: list[Outcome] = []
        progress = Progress(len(ids)) if len(ids) > 1 else None
        started = time.monotonic()

        def done(outcome: Outcome) -> None:
            outcomes.append(outcome)
            if progress is not None:
                progress.step(outcome.status == "success")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.receive)
            await client.run_many(ids, payload, min(args.window, len(ids)), done)
            nursery.cancel_scope.cancel()
    if progress is None:
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


def format_status(report: dict[str, Any]) -> str:
    workers = report.get("workers", [])
    lines = [f"workers: {report.get('workers_total', len(workers))}"]
    if workers:
        lines.append(
            f"  {'id':>6} {'pid':>8}  {'state':<9} {'task':>8} {'last pulse':>11} {'done':>8}"
        )
        for w in workers:
            lines.append(
                f"  {w['id']:>6} {w['pid'] or '-':>8}  {w['state']:<9} {w['task']:>8}"
                f" {w['last_pulse_s']:>9.1f} s {w['done']:>8}"
            )
    tasks = report.get("tasks", {})
    lines.append("tasks: " + ", ".join(f"{k} {v}" for k, v in tasks.items()))
    lines.append(
        f"retries {report.get('retries', 0)}, restarts sent {report.get('restarts_sent', 0)}, "
        f"workers lost {report.get('worker_losses', {}) or 'none'}"
    )
    door = report.get("front_door")
    if door:
        lines.append("front door: " + ", ".join(f"{k} {v}" for k, v in door.items()))
    return "\n".join(lines)


async def run_status(args: argparse.Namespace) -> int:
    family, server = resolve(args.server)
    with stdsocket.socket(family, stdsocket.SOCK_DGRAM) as sock:
        sock.bind(("::" if family == stdsocket.AF_INET6 else "0.0.0.0", 0))
        client = Client(sock, server, args.timeout)
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
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader went away (`udp-client status | head`): no traceback, like other tools.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


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


if __name__ == "__main__":
    raise SystemExit(main())
