"""`worker` command line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import trio

from controller.affinity import AffinityError, parse_cpus, pin
from controller.cli import add_common_flags, setup_logging
from controller.config import ConfigError, load_config
from worker.runner import SetupError, build_runner
from worker.shell import WorkerShell


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="worker",
        description=(
            "Register with the controller on SOCKET_DIR/main.sock, pulse, and run one task at a "
            "time. Without --exec or --handler the built-in echo handler returns the payload."
        ),
        epilog=(
            "Examples: worker --socket-dir ./.run --handler mypkg.jobs:run | "
            "worker --exec ./job.sh --fast (--exec takes the rest of the line)"
        ),
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="controller JSON config (socket_dir, dial_timeout, max_extra_size)",
    )
    parser.add_argument(
        "--socket-dir", metavar="DIR", help="directory of main.sock (default: /run/controller)"
    )
    parser.add_argument(
        "--pulse",
        metavar="SECONDS",
        type=_positive,
        default=1.0,
        help="real period between pulses (default 1); promises next_pulse = max(1, ceil(2 x it))",
    )
    parser.add_argument(
        "--drain-timeout",
        metavar="SECONDS",
        type=_positive,
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
    parser.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="drain and exit when the parent process ends (used by controller --workers)",
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, "worker")
    try:
        if args.cpus is not None:
            pin(args.cpus)
        config = load_config(args.config)
        if args.socket_dir:
            config = config.replace(socket_dir=Path(args.socket_dir))
        if args.exec_argv is not None and not args.exec_argv:
            raise SetupError("--exec needs a command")
        runner = build_runner(args.exec_argv, args.handler, config.max_extra_size)
    except (ConfigError, SetupError, AffinityError) as exc:
        print(f"worker: {exc}", file=sys.stderr)
        return 2
    shell = WorkerShell(
        config.socket_dir,
        runner,
        pulse_period=args.pulse,
        drain_timeout=args.drain_timeout,
        dial_timeout=config.dial_timeout,
        max_extra_size=config.max_extra_size,
        parent_pid=os.getppid() if args.exit_with_parent else None,
    )
    return trio.run(shell.run)
