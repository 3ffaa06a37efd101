"""`controller` command line: config, then the pulse server, timer, front door and local workers."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

import trio

from controller.config import Config, ConfigError, load_config
from controller.logs import LEVELS, setup_logging
from controller.shell.server import ControllerShell, StartupError
from controller.shell.supervisor import Supervisor, worker_command
from controller.shell.udp import UdpDoor

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="controller",
        description=(
            "Dispatch jobs to worker processes over Unix sockets. Workers register on "
            "SOCKET_DIR/main.sock; clients submit jobs over UDP (see udp-client)."
        ),
        epilog=(
            "Arguments after -- go to every local worker, e.g. "
            "'controller --workers auto -- --exec ./job.sh'. Config keys: see docs/DESIGN.md."
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
    parser.add_argument("--log-level", choices=LEVELS, default="INFO", type=str.upper)
    return parser


def split_worker_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


async def run_controller(config: Config, workers: int, worker_args: list[str]) -> None:
    shell = ControllerShell(config)
    door = UdpDoor(config, shell)
    await shell.bind()
    door.bind()
    async with trio.open_nursery() as nursery:
        await nursery.start(shell.serve)
        await nursery.start(door.serve)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as local:
                if workers:
                    argv = worker_command(str(config.socket_dir), worker_args)
                    await local.start(Supervisor(workers, argv).run)
                    log.info("supervising %d local workers", workers)
                async for signum in signals:
                    log.info("%s: shutting down", signal.Signals(signum).name)
                    break
                # Local workers drain and say SHUTDOWN while main.sock still answers.
                local.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    own, worker_args = split_worker_args(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(own)
    setup_logging(args.log_level, "controller")
    try:
        config = load_config(args.config)
        if args.socket_dir:
            config = config.replace(socket_dir=Path(args.socket_dir))
        trio.run(run_controller, config, args.workers, worker_args)
    except (ConfigError, StartupError) as exc:
        print(f"controller: {exc}", file=sys.stderr)
        return 2
    return 0
