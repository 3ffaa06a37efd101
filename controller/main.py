"""The `controller` command: its options, the configuration, the assembled parts
(controller/app.py), the local workers' supervisor, systemd's notifications and the signals."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import stat
import sys
from pathlib import Path

import trio

from controller.affinity import format_cpus, parse_cpus, pin
from controller.app import assemble
from controller.cli import DOCS, add_common_flags, setup_logging
from controller.config import Config, load_config, secret_files
from controller.errors import CannotStart, StartupError
from controller.journal import Journal
from controller.priority import DEFAULT_ADJUSTMENT, adjust, parse_adjustment
from controller.shell.core_shell import CoreShell
from controller.shell.descriptors import raise_nofile_limit
from controller.shell.metrics import Metrics
from controller.shell.sdnotify import Notifier
from controller.shell.supervisor import Supervisor, worker_command

log = logging.getLogger("controller")


def _workers(text: str) -> int:
    if text == "auto":
        return os.cpu_count() or 1
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None
    if count < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {count}")
    return count


def _busy_poll(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        micros = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected whole microseconds or 'auto', got {text!r}"
        ) from None
    if not 0 <= micros <= 1_000_000:
        raise argparse.ArgumentTypeError(f"must be 0 to 1000000 microseconds, got {micros}")
    return micros / 1e6


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="controller",
        description=(
            "Dispatch jobs to worker processes. Local workers register on SOCKET_DIR/main.sock; "
            "calculators (worker --udp) and pollers (worker --hub) join over the network. Jobs "
            "come in over UDP (client_address, see udp-client), HTTP (http_address) and a "
            "Redis stream shared with other controllers (redis)."
        ),
        epilog=(
            "Arguments after -- go to every local worker, e.g. "
            "'controller --workers auto -- --exec ./job.sh'. "
            f"Config keys and their defaults: {DOCS}."
        ),
    )
    parser.add_argument("--config", metavar="FILE", help="JSON config file (every key optional)")
    parser.add_argument(
        "--socket-dir", metavar="DIR", help="overrides socket_dir (default /run/controller)"
    )
    parser.add_argument(
        "--workers",
        metavar="N|auto",
        type=_workers,
        default=0,
        help="start and supervise N local workers; auto = one per CPU (default 0)",
    )
    parser.add_argument(
        "--cpus",
        metavar="LIST",
        type=parse_cpus,
        help="run the controller only on these CPUs, e.g. 0 or 0,2-3 (local workers are not "
        "pinned unless given their own --cpus after --); see docs/operations.md, Tuning",
    )
    parser.add_argument(
        "--busy-poll",
        metavar="MICROSECONDS|auto",
        type=_busy_poll,
        default=None,
        help="keep polling for this long after the last event before sleeping; 0: never; "
        "auto (default): up to 200 us while events come less than 200 us apart, never when "
        "idle or when jobs take milliseconds. A fixed value suits a controller on a CPU of "
        "its own (--cpus), which it keeps busy while jobs flow",
    )
    parser.add_argument(
        "--nice",
        metavar="ADJUSTMENT",
        type=parse_adjustment,
        default=DEFAULT_ADJUSTMENT,
        help="run the controller this many nice levels from where it was started, e.g. -10: "
        "ahead of its workers and clients for the CPU (local workers keep the starting "
        f"level). Default {DEFAULT_ADJUSTMENT}. Measured: little gain even with very short "
        "jobs (docs/operations.md, Tuning). Going below the starting level needs root or "
        "CAP_SYS_NICE; without, it says so and runs as started",
    )
    add_common_flags(parser)
    return parser


def slot_job_users(config: Config, workers: int, worker_args: list[str]) -> list[str | None]:
    """Each local slot's job user (config `job_users`); StartupError when the list names
    fewer users than there are slots, or the workers' arguments name one as well."""
    if config.job_users is None:
        return [None] * workers
    if workers and any(a == "--job-user" or a.startswith("--job-user=") for a in worker_args):
        raise StartupError(
            "job_users is set in the configuration and --job-user is among the workers' "
            "arguments (after --): give the job users in one place"
        )
    if not isinstance(config.job_users, str) and len(config.job_users) < workers:
        raise StartupError(
            f"job_users names {len(config.job_users)} users, but --workers {workers} needs one "
            "per slot (slots are numbered 0 to N-1)"
        )
    return [config.job_user(slot) for slot in range(workers)]


def split_worker_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def status_line(shell: CoreShell, journal: Journal | None) -> str:
    """One line for `systemctl status`."""
    core = shell.core
    running = len(core.tasks) - core.queued - core.scheduled
    line = (
        f"{len(core.workers)} workers ({core.idle_workers} idle), "
        f"{core.queued} queued, {running} running, {core.counters.succeeded} done"
    )
    if journal is not None and journal.failing:
        line += f"; JOURNAL FAILING: {journal.failing}"
    return line


async def run_controller(
    config: Config,
    workers: int,
    worker_args: list[str],
    worker_cpus: frozenset[int] | None = None,
    busy_poll: float | None = 0.0,
    worker_nice: int | None = None,
) -> None:
    job_users = slot_job_users(config, workers, worker_args)
    before, soft = raise_nofile_limit()
    if soft != before:
        log.info("descriptor limit raised from %d to %d", before, soft)
    journal = recovered = None
    if config.journal is not None:
        journal = Journal.open(config.journal, config.journal_sync)
        recovered = journal.load()
    metrics = Metrics() if config.metrics_address is not None else None
    parts = assemble(config, journal, recovered, metrics, busy_poll)
    await parts.bind()
    notifier = Notifier()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(parts.serve)
            notifier.notify("READY=1")
            nursery.start_soon(
                notifier.run, functools.partial(status_line, parts.shell, journal), parts.shell.lag
            )
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async with trio.open_nursery() as local:
                    if workers:
                        argv = worker_command(str(config.socket_dir), worker_args)
                        each = [
                            worker_command(str(config.socket_dir), worker_args, user)
                            for user in job_users
                        ]
                        supervisor = Supervisor(
                            workers, argv, cpus=worker_cpus, nice=worker_nice, slot_argvs=each
                        )
                        await local.start(supervisor.run)
                        log.info("supervising %d local workers", workers)
                    async for signum in signals:
                        log.info("%s: shutting down", signal.Signals(signum).name)
                        notifier.notify("STOPPING=1")
                        break
                    # Local workers drain and say SHUTDOWN while main.sock still answers.
                    local.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
    finally:
        notifier.close()
        if journal is not None:
            journal.close()


def warn_readable_secrets(config: Config, source: str | None) -> None:
    """Once at start: a file holding a secret that anyone but the controller's user may read
    (job code runs as other users; the packaged config is root's, 0600)."""
    me = os.geteuid()
    for path, holds in secret_files(config, source):
        try:
            st = path.stat()
        except OSError:
            continue  # the door that reads it says why when it does
        if st.st_uid != me or st.st_mode & 0o077:
            logging.getLogger("controller").warning(
                "%s holds %s and is readable by others (owner uid %d, mode %04o): "
                "chmod 600 it, owned by uid %d",
                path,
                holds,
                st.st_uid,
                stat.S_IMODE(st.st_mode),
                me,
            )


def main(argv: list[str] | None = None) -> int:
    own, worker_args = split_worker_args(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(own)
    if args.workers and worker_args:
        from worker.main import check_arguments

        problem = check_arguments(worker_args)
        if problem:
            print(f"controller: the workers' arguments (after --): {problem}", file=sys.stderr)
            return 2
    setup_logging(args.log_level, "controller")
    try:
        config = load_config(args.config)
        warn_readable_secrets(config, args.config)
        if args.socket_dir:
            config = config.replace(socket_dir=Path(args.socket_dir))
        worker_cpus = None
        if args.cpus is not None:
            worker_cpus = pin(args.cpus)  # local workers keep the CPUs the controller had
            logging.getLogger("controller").info("running on CPUs %s", format_cpus(args.cpus))
        worker_nice = adjust(args.nice)  # before trio starts a thread: they take it too
        trio.run(
            run_controller,
            config,
            args.workers,
            worker_args,
            worker_cpus,
            args.busy_poll,
            worker_nice,
        )
    except CannotStart as exc:
        print(f"controller: {exc}", file=sys.stderr)
        return 2
    return 0
