"""`make bench-peers`: the same workload against Gearman, Celery, Dramatiq, RQ and Huey, and ours.

2 workers, no-op jobs, one client: throughput (JOBS submitted, then every result collected)
and one job at a time (submit, wait for the result; p50 and p99), for each peer and for our
three doors (UDP, HTTP, Redis), each with 2 workers of each kind (local, calculators,
pollers; default layout, journal on), beside ProcessPoolExecutor(2), all in the same run.
The peers' Python packages go in a venv of their own (.venv-peers), Debian's redis-server,
gearman-job-server and gearman-tools are installed when missing (as root), and every server
and worker is started here and stopped by pid (its process group) at the end. Prints a
table, writes bench/peers.json and bench/peers.png.

Then jobs of 1 ms and 10 ms, sleeping or busy, as `--handler` and as `--exec` of a small
script, against Gearman's command worker and the peers (bench/peers_lengths.py; alone with
`--lengths`): a table per length of jobs/s and efficiency (jobs/s over 2 / length), under
the key "lengths" of bench/peers.json, and bench/peers_lengths.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio

from bench.common import percentile, socket_dir
from bench.e2e_bench import drive, ppe_rate
from bench.http_bench import _async_throughput, _one_at_a_time
from bench.peers_workers import VENV, process_group, worker_commands
from bench.redis_bench import redis_rate
from bench.remote_bench import controller_with
from controller.client import Client
from tests.helpers import RedisServer, free_tcp_port, wait_for_condition

HERE = Path(__file__).parent
PACKAGES = ["celery[redis]", "dramatiq[redis]", "rq", "huey", "redis", "python3-gearman"]
SYSTEMS = ("gearman", "huey", "celery", "dramatiq", "rq")
KINDS = ("local", "calculator", "poller")


def ensure_tools() -> None:
    """Debian's servers (as root, when missing) and the peers' venv."""
    need = [
        pkg
        for cmd, pkg in (
            ("redis-server", "redis-server"),
            ("gearmand", "gearman-job-server"),
            ("gearman", "gearman-tools"),  # the command worker of the job-length section
        )
        if shutil.which(cmd) is None and not Path(f"/usr/sbin/{cmd}").exists()
    ]
    if need:
        if os.geteuid() != 0:
            raise SystemExit(f"bench-peers needs {' '.join(need)} (apt-get install, as root)")
        print(f"installing {' '.join(need)}", flush=True)
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", *need], check=True)
    stamp = VENV / ".installed"
    if not stamp.exists():
        print(f"creating {VENV} with {', '.join(PACKAGES)}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pip = [str(VENV / "bin" / "pip"), "install", "--quiet"]
        subprocess.run([*pip, "--upgrade", "pip"], check=True)
        subprocess.run([*pip, *PACKAGES], check=True)
        stamp.touch()


def measure_peer(
    system: str, jobs: int, one: int, env: dict[str, str], logs: Path
) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        for n, argv in enumerate(worker_commands(system, env["PEERS_REDIS"])):
            stack.enter_context(process_group(argv, env, logs / f"{system}-worker{n}.log"))
        driver = [
            str(VENV / "bin" / "python"),
            "peers_tasks.py",
            "measure",
            system,
            str(jobs),
            str(one),
        ]
        done = subprocess.run(
            driver, cwd=HERE, env=env, capture_output=True, text=True, timeout=900
        )
    if done.returncode != 0:
        print(f"  {system}: failed: {done.stderr.strip().splitlines()[-1:]}", flush=True)
        return {"error": done.stderr.strip()[-500:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _redis_one_at_a_time(url: str, jobs: int) -> list[float]:
    out = []
    with Client(url) as client:
        for _ in range(jobs):
            start = time.perf_counter()
            client.submit(b"").result(timeout=60)
            out.append(time.perf_counter() - start)
    return out


def measure_ours(
    redis_url: str, jobs: int, one: int, kinds: tuple[str, ...] = KINDS
) -> dict[str, dict[str, Any]]:
    """Each door (UDP, HTTP, Redis) with 2 workers of each kind (local, calculator, poller);
    default layout, journal on."""

    def figures(rate: float, lat: list[float]) -> dict[str, Any]:
        return {
            "jobs_per_s": round(rate),
            "p50_ms": round(percentile(lat, 0.5) * 1000, 3),
            "p99_ms": round(percentile(lat, 0.99) * 1000, 3),
        }

    rows = {}
    for kind in kinds:
        stream = f"bench-{kind}"
        url = f"{redis_url}?stream={stream}"
        # The HTTP client's 64 connections, opened again as the controller closes idle ones,
        # would pass max_connections_per_client (64) and be refused.
        with controller_with(
            kind, redis={"url": redis_url, "stream": stream}, max_connections_per_client=1024
        ) as ctl:
            trio.run(drive, ctl.udp_port, 300, 8, 50_000_000)  # warm up
            redis_rate(url, 300)
            udp_rate, _ = trio.run(drive, ctl.udp_port, jobs, 64, 1)
            _, udp_lat = trio.run(drive, ctl.udp_port, one, 1, 60_000_000)
            http_rate = trio.run(_async_throughput, ctl.url, jobs)
            http_lat = trio.run(_one_at_a_time, ctl.url, one)
            stream_rate = redis_rate(url, jobs)
            stream_lat = _redis_one_at_a_time(url, one)
        workers = {"local": "local", "calculator": "calculators", "poller": "pollers"}[kind]
        rows[f"ours: UDP, {workers}"] = figures(udp_rate, udp_lat)
        rows[f"ours: HTTP, {workers}"] = figures(http_rate, http_lat)
        rows[f"ours: Redis, {workers}"] = figures(stream_rate, stream_lat)
    return rows


def plot(rows: dict[str, dict[str, Any]], ppe: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in rows.items() if "jobs_per_s" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colors = ["tab:blue" if n.startswith("ours") else "tab:gray" for n in names]
    left.barh(names, [rows[n]["jobs_per_s"] for n in names], color=colors)
    left.axvline(ppe, color="tab:red", linestyle="--", label=f"ProcessPoolExecutor(2) {ppe:,.0f}")
    left.set_xlabel("no-op jobs per second (2 workers, one client)")
    left.legend(loc="upper right")
    right.barh(names, [rows[n]["p50_ms"] for n in names], color=colors)
    right.set_xscale("log")
    right.set_xlabel("one job at a time, p50 ms, log scale (lower is better)")
    right.set_yticks([])
    fig.suptitle("Same workload, same run, this 2-core machine")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@contextlib.contextmanager
def peer_servers(tmp: Path, logs: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """redis-server and gearmand on free ports, stopped by pid at the end: Redis's URL and the
    environment of the peers' workers and client."""
    server = RedisServer(tmp / "redis")
    server.start()
    gear_port = free_tcp_port()
    gearmand = shutil.which("gearmand") or "/usr/sbin/gearmand"
    try:
        with process_group(
            [
                gearmand,
                "-p",
                str(gear_port),
                "-L",
                "127.0.0.1",
                "-l",
                str(logs / "gearmand.log"),
                "-P",
                str(tmp / "gearmand.pid"),
                "-t",
                "1",
            ],
            dict(os.environ),
            logs / "gearmand.out",
        ):
            env = dict(
                os.environ,
                PEERS_REDIS=f"redis://127.0.0.1:{server.port}",
                PEERS_GEARMAN_PORT=str(gear_port),
                PYTHONPATH=str(HERE),
            )
            wait_for_condition(lambda: _listening(gear_port))
            yield server.url, env
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench-peers", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=5000, help="jobs per throughput run")
    parser.add_argument("--one", type=int, default=300, help="jobs one at a time, for latency")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="peers to run")
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help="our worker kinds to run (each door with each)"
    )
    parser.add_argument(
        "--lengths", action="store_true", help="only the section of jobs of a given length"
    )
    parser.add_argument(
        "--length-ms", default="1,10", help="job lengths of that section, in milliseconds"
    )
    parser.add_argument(
        "--work-seconds",
        type=float,
        default=3.0,
        help="seconds of work per row of that section (jobs x length / 2 workers)",
    )
    args = parser.parse_args()
    ensure_tools()
    systems = tuple(s for s in args.systems.split(",") if s)
    if not args.lengths:
        noop_section(args, systems)
    lengths_section(args, systems)


def lengths_section(args: argparse.Namespace, systems: tuple[str, ...]) -> None:
    from bench import peers_lengths
    from bench.plots import efficiency_by_length

    lengths = tuple(float(ms) / 1000 for ms in args.length_ms.split(","))
    with socket_dir() as tmp:
        logs = tmp / "logs"
        logs.mkdir()
        with peer_servers(tmp, logs) as (_, env):
            section = peers_lengths.run(systems, env, logs, lengths, args.work_seconds)
    peers_lengths.print_tables(section)
    path = HERE / "peers.json"
    figures = json.loads(path.read_text()) if path.exists() else {}
    figures["lengths"] = section
    path.write_text(json.dumps(figures, indent=2) + "\n")
    baselines = (peers_lengths.LABELS["ppe"], peers_lengths.LABELS["bare-script"])
    efficiency_by_length(section["rows"], HERE / "peers_lengths.png", baselines)
    print(f'written {path} ("lengths"), {HERE / "peers_lengths.png"}')


def noop_section(args: argparse.Namespace, systems: tuple[str, ...]) -> None:
    rows: dict[str, dict[str, Any]] = {}
    with socket_dir() as tmp:
        logs = tmp / "logs"
        logs.mkdir()
        with peer_servers(tmp, logs) as (redis_url, env):
            for system in systems:
                print(f"measuring {system} ...", flush=True)
                rows[system] = measure_peer(system, args.jobs, args.one, env, logs)
            print("measuring our doors ...", flush=True)
            kinds = tuple(kind for kind in args.kinds.split(",") if kind)
            rows.update(measure_ours(redis_url, args.jobs, args.one, kinds))
        ppe = ppe_rate(2, args.jobs * 2)
    print(f"\n{'system':<20} {'jobs/s':>8} {'x PPE(2)':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for name, row in rows.items():
        if "jobs_per_s" not in row:
            print(f"{name:<20} failed: {row.get('error', '')[:60]}")
            continue
        print(
            f"{name:<20} {row['jobs_per_s']:>8,} {row['jobs_per_s'] / ppe:>9.2f} "
            f"{row['p50_ms']:>8.3f} {row['p99_ms']:>8.3f}"
        )
    print(f"{'ProcessPoolExecutor(2)':<20} {ppe:>8,.0f} {1:>9.2f}")
    (HERE / "peers.json").write_text(
        json.dumps(
            {
                "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                "ppe_jobs_per_s": round(ppe),
                "systems": rows,
            },
            indent=2,
        )
        + "\n"
    )
    plot(rows, ppe, HERE / "peers.png")
    print(f"written {HERE / 'peers.json'}, {HERE / 'peers.png'}")


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


if __name__ == "__main__":
    main()
