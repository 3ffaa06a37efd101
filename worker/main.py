"""The `worker` command line: its flags, the job user and limits it sets up for `--exec` jobs
(`build_jail`), and the worker it runs: a local worker (worker/local/), a calculator
(`--udp`, worker/calculator.py) or a poller (`--hub`, worker/poller.py)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import trio

from controller.affinity import AffinityError, parse_cpus, pin
from controller.cli import add_common_flags, positive_seconds, setup_logging
from controller.config import ConfigError, load_config
from controller.declared import BadDeclaration, Declared, names, read
from controller.joblimits import JobLimits, LimitError, parse_value
from worker.calculator import Calculator
from worker.errors import SetupError
from worker.limits.cgroups import Cgroup
from worker.limits.jail import Jail
from worker.limits.users import become, resolve_job_user
from worker.local.worker import LocalWorker
from worker.output import capture_stderr
from worker.parent import parent_alive, tie_to_parent
from worker.poller import Poller
from worker.runner import build_runner

log = logging.getLogger("worker")


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _names(what: str) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        try:
            return names(text, what)
        except BadDeclaration as exc:
            raise argparse.ArgumentTypeError(exc.why) from None

    return parse


class _Refused(Exception):
    """What argparse would have printed before exiting 2."""


class _CheckingParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _Refused(message)


def build_parser(
    parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
) -> argparse.ArgumentParser:
    parser = parser_class(
        prog="worker",
        description=(
            "Run the controller's jobs, one at a time. A local worker registers on "
            "SOCKET_DIR/main.sock; with --udp it is a calculator on another host (heartbeats and "
            "jobs over UDP), with --hub a poller (it asks the HTTP job API for work). Without "
            "--exec or --handler the built-in echo handler returns the payload."
        ),
        epilog=(
            "Examples: worker --socket-dir ./.run --handler mypkg.jobs:run | "
            "worker --udp ctl.example:5555 --exec ./job.sh | "
            "worker --hub https://ctl.example:8443 --token-file /etc/controller/token "
            "--exec ./job.sh (--exec takes the rest of the line)"
        ),
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="controller JSON config (socket_dir, dial_timeout, max_extra_size)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--socket-dir", metavar="DIR", help="directory of main.sock (default: /run/controller)"
    )
    where.add_argument(
        "--udp",
        metavar="HOST:PORT",
        type=_address,
        help="be a calculator: heartbeats and jobs over UDP to the controller's client port",
    )
    where.add_argument(
        "--hub",
        metavar="URL",
        help="be a poller: ask the controller's HTTP API (http[s]://HOST:PORT[/PREFIX/]) for "
        "jobs; HTTPS_PROXY, HTTP_PROXY and NO_PROXY are honoured",
    )
    parser.add_argument(
        "--token-file", metavar="FILE", help="with --hub: a file whose first line is the token"
    )
    parser.add_argument(
        "--ca-file",
        metavar="FILE",
        help="with an https --hub: trust only this CA (PEM) instead of the system's trust store",
    )
    parser.add_argument(
        "--name", metavar="NAME", help="with --hub: the poller's name (default: HOST-PID)"
    )
    parser.add_argument(
        "--pulse",
        metavar="SECONDS",
        type=positive_seconds,
        default=1.0,
        help="real period between pulses (default 1); promises next_pulse = max(1, ceil(2 x it))",
    )
    parser.add_argument(
        "--queues",
        metavar="A,B",
        type=_names("queues"),
        default=("default",),
        help="the queues this worker takes jobs from, comma separated (default: default); "
        "names are 1 to 64 of a-z 0-9 _ . -",
    )
    parser.add_argument(
        "--labels",
        metavar="X,Y",
        type=_names("labels"),
        default=(),
        help="what this worker has, for jobs' `requires`, comma separated (default: none)",
    )
    parser.add_argument(
        "--drain-timeout",
        metavar="SECONDS",
        type=positive_seconds,
        default=30.0,
        help="on SIGTERM, how long a running task may take to finish (default 30)",
    )
    parser.add_argument(
        "--cpus",
        metavar="LIST",
        type=parse_cpus,
        help="run only on these CPUs, e.g. 1 or 2-3 (default: wherever the system puts it)",
    )
    add_common_flags(parser)
    strangers = parser.add_argument_group(
        "jobs as strangers (--exec jobs; --handler code runs inside the worker and is trusted)"
    )
    strangers.add_argument(
        "--job-user",
        metavar="USER|UID",
        help="run every --exec job as this user (a name, or a uid; a uid with no passwd entry "
        "runs with gid = uid), never as root or the worker's own user; needs root or "
        "CAP_SETUID and CAP_SETGID",
    )
    strangers.add_argument(
        "--user",
        metavar="USER",
        help="started as root, run as USER once set up, keeping only CAP_SETUID, CAP_SETGID "
        "and CAP_KILL when there is a --job-user",
    )
    for flag, key, what in _LIMIT_FLAGS:
        strangers.add_argument(
            flag, metavar=what, type=_limit(key), dest=key, help=_LIMIT_HELP[key]
        )
    parser.add_argument(
        "--seed-protocol",
        action="store_true",
        help="speak the seed's exchange (one connection per message, a control socket of its "
        "own) instead of asking for a channel on main.sock (local workers)",
    )
    parser.add_argument(
        "--one-task",
        action="store_true",
        help="on the channel, hold no next task while one runs (by default a local worker "
        "takes one, so that it never waits for the controller between jobs)",
    )
    parser.add_argument(
        "--exit-with-parent",
        metavar="PID",
        nargs="?",
        type=_pid,
        const=0,
        help="drain and exit when the parent process (PID, default: the parent it has at "
        "start) ends; exit at once if it already has (used by controller --workers)",
    )
    parser.add_argument(
        "--handler",
        metavar="MODULE:FUNC",
        help="Python callable: payload bytes in, result bytes out; an exception fails the task",
    )
    parser.add_argument(
        "--exec",
        dest="exec_argv",
        metavar="CMD",
        nargs=argparse.REMAINDER,
        help="run CMD [ARG...] per task: payload on stdin, TASK_ID in its environment, "
        "stdout is the result (takes the rest of the line)",
    )
    return parser


_LIMIT_FLAGS = (
    ("--memory-max", "memory_max", "SIZE"),
    ("--tasks-max", "tasks_max", "N"),
    ("--cpu-time", "cpu_time", "SECONDS"),
    ("--file-size", "file_size", "SIZE"),
    ("--open-files", "open_files", "N"),
    ("--cpu-quota", "cpu_quota", "FRACTION"),
)
_LIMIT_HELP = {
    "memory_max": "a job's memory ceiling in bytes, or with K, M, G (1024-based): "
    "RLIMIT_AS, and memory.max in a cgroup",
    "tasks_max": "a job's processes and threads (RLIMIT_NPROC with --job-user; pids.max)",
    "cpu_time": "a job's CPU seconds (RLIMIT_CPU: SIGXCPU, SIGKILL a second later)",
    "file_size": "the size one file of a job may grow to (RLIMIT_FSIZE: SIGXFSZ)",
    "open_files": "a job's open descriptors (RLIMIT_NOFILE)",
    "cpu_quota": "a fraction of one CPU a job may use (cgroup v2 cpu.max only)",
}


def _limit(key: str) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            return parse_value(key, text)
        except LimitError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _ceilings(args: argparse.Namespace) -> JobLimits:
    return JobLimits(**{key: getattr(args, key) for _, key, _ in _LIMIT_FLAGS})


def build_jail(args: argparse.Namespace) -> Jail:
    """Who --exec jobs run as and under which limits; switches to --user on the way (after
    it, the worker holds only what it needs). SetupError when it cannot be done."""
    job_user = resolve_job_user(args.job_user) if args.job_user is not None else None
    if args.exec_argv is None and (job_user is not None or not _ceilings(args).is_empty()):
        log.warning("--job-user and the limits apply to --exec jobs; --handler code is trusted")
    if args.user is not None:
        become(args.user, keep_job_caps=job_user is not None)
    elif job_user is not None and os.geteuid() == 0:
        log.warning("running as root: give --user so that the worker itself is not root")
    ceilings = _ceilings(args)
    cgroup = None
    if job_user is not None or not ceilings.is_empty():
        try:
            cgroup = Cgroup(Cgroup.find())
            cgroup.setup()
        except (SetupError, OSError) as exc:
            log.info("no cgroup for jobs: %s", exc)
            cgroup = None
    jail = Jail(job_user, ceilings, cgroup)
    jail.setup()
    return jail


def _pid(text: str) -> int:
    if not text.isdigit() or int(text) < 2:
        raise argparse.ArgumentTypeError(f"expected a process id above 1, got {text!r}")
    return int(text)


def _declared(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Declared:
    if not args.queues:
        parser.error("argument --queues: give at least one queue")
    try:
        return read(args.queues, args.labels)
    except BadDeclaration as exc:
        parser.error(f"arguments --queues and --labels: {exc.why}")


def check_arguments(argv: list[str]) -> str | None:
    """Why `worker` would refuse these arguments at once (exit 2), or None: lets
    `controller --workers N -- ARGS` refuse a mistake before starting N workers that
    would each exit with it."""
    parser = build_parser(_CheckingParser)
    try:
        _declared(parser, parser.parse_args(argv))
    except _Refused as exc:
        return str(exc)
    except SystemExit:  # --help or --version: nothing wrong
        pass
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    declared = _declared(parser, args)
    # First: the logging set up next writes through it, so that what a --handler logs while a
    # job runs is that job's output.
    capture_stderr()
    setup_logging(args.log_level, "worker")
    parent = None
    if args.exit_with_parent is not None:
        parent = args.exit_with_parent or os.getppid()
        try:
            tied = tie_to_parent(parent)
        except OSError as exc:  # prctl refused (a seccomp filter): only the start is checked
            log.warning("cannot ask to be told when the parent ends (%s)", exc.strerror)
            tied = parent_alive(parent)
        if not tied:
            log.warning("parent process %d ended before the worker started: exiting", parent)
            return 0
    try:
        if args.cpus is not None:
            pin(args.cpus)
        config = load_config(args.config)
        if args.socket_dir:
            config = config.replace(socket_dir=Path(args.socket_dir))
        if args.exec_argv is not None and not args.exec_argv:
            raise SetupError("--exec needs a command")
        if args.ca_file is not None and args.hub is None:
            raise SetupError("--ca-file goes with an https --hub")
        jail = build_jail(args)
        runner = build_runner(args.exec_argv, args.handler, config.max_extra_size, jail)
    except (ConfigError, SetupError, AffinityError) as exc:
        print(f"worker: {exc}", file=sys.stderr)
        return 2
    if args.exec_argv is not None:
        log.info(jail.describe())
        if jail.job_user is not None:
            log.info("jobs run as %s (uid %d)", jail.job_user.name, jail.job_user.uid)
    if args.udp is not None:
        calculator = Calculator(
            args.udp,
            runner,
            pulse_period=args.pulse,
            drain_timeout=args.drain_timeout,
            declared=declared,
            parent_pid=parent,
        )
        log.info("calculator for %s:%d", *args.udp)
        try:
            return trio.run(calculator.run)
        finally:
            jail.close()
    if args.hub is not None:
        try:
            poller = Poller(
                args.hub,
                runner,
                name=args.name,
                token_file=args.token_file,
                ca_file=args.ca_file,
                pulse_period=args.pulse,
                drain_timeout=args.drain_timeout,
                declared=declared,
                parent_pid=parent,
            )
        except SetupError as exc:
            print(f"worker: {exc}", file=sys.stderr)
            return 2
        log.info("poller %s for %s", poller.name, args.hub)
        try:
            return trio.run(poller.run)
        finally:
            jail.close()
    worker = LocalWorker(
        config.socket_dir,
        runner,
        pulse_period=args.pulse,
        drain_timeout=args.drain_timeout,
        dial_timeout=config.dial_timeout,
        max_extra_size=config.max_extra_size,
        parent_pid=parent,
        declared=declared,
        channel=not args.seed_protocol,
        next_task=not args.one_task,
    )
    return trio.run(worker.run)
