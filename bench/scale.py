"""`make bench-scale`: how one controller scales with the host's CPUs (DESIGN section 16).

For 1, 2, 4, ... workers up to every CPU of the host (`os.cpu_count()`; the last count is the
CPU count itself when it is no power of two), jobs of 0, 1 and 10 ms (`--handler
bench.work:run` sleeping that long), through the UDP door with a windowed client: jobs/s,
the controller's CPU per job, and ProcessPoolExecutor(n) running the same sleeps right after
in the same run; journal off and on. One table per journal setting, in Markdown, and the
figures as JSON (`--json FILE`), and a plot of jobs/s against workers (bench/scale.png,
`--plot FILE`).

    python -m bench.scale                       # the full run (a minute or two on 2 CPUs)
    python -m bench.scale --workers 2 --lengths-ms 0 --journal off --protocol channel,one-task
    python -m bench.scale --targets             # section 16's 2-CPU targets, each protocol

`--protocol` names the workers' ways of talking, comma-separated: `channel` (the default: the
channel, holding a next task), `one-task` (the channel, `worker --one-task`: one task at a
time) and `seed` (`worker --seed-protocol`). The machine may be shared: each point is
measured `--rounds` times (ours and the pool alternately) and the median shown, with the
spread (lowest-highest) of ours.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

from bench import work
from bench.common import importable_bench, median, process_cpu, socket_dir
from bench.e2e_bench import drive, start_controller
from tests.helpers import free_udp_port

HANDLER = ("--handler", "bench.work:run")
# The workers' flags for each way of talking to the controller.
PROTOCOLS: dict[str, tuple[str, ...]] = {
    "channel": (),
    "one-task": ("--one-task",),
    "seed": ("--seed-protocol",),
}
EXEC_TRUE = ("--exec", "/usr/bin/true")


def worker_counts(cpus: int) -> list[int]:
    """1, 2, 4, ... up to `cpus`, and `cpus` itself."""
    counts, n = [], 1
    while n < cpus:
        counts.append(n)
        n *= 2
    counts.append(cpus)
    return counts


def jobs_for(workers: int, length: float, seconds: float) -> int:
    """About `seconds` of jobs at the ideal rate (no-op jobs: as if 0.2 ms each)."""
    return max(200, min(50_000, int(seconds * workers / max(length, 0.0002))))


def ppe_rate(workers: int, length: float, jobs: int) -> float:
    """ProcessPoolExecutor(workers) running `jobs` of the same sleeps, one future each."""
    payload = f"sleep {length}".encode()
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        list(pool.map(work.run, [payload] * (workers * 4)))  # warm up the pool
        start = time.perf_counter()
        futures = [pool.submit(work.run, payload) for _ in range(jobs)]
        for future in futures:
            future.result()
        return jobs / (time.perf_counter() - start)


class Ours:
    """A controller with `workers` local workers speaking `protocol` (a key of PROTOCOLS)."""

    def __init__(
        self,
        sockdir: Path,
        workers: int,
        journal: bool,
        protocol: str,
        worker_args: tuple[str, ...],
    ) -> None:
        self.port = free_udp_port()
        extra: dict[str, Any] = {"journal": str(sockdir / "journal.sqlite3") if journal else None}
        args = (*PROTOCOLS[protocol], *worker_args)
        self.proc = start_controller(sockdir, self.port, workers, extra, worker_args=args)
        self.next_id = 1
        # warm up; waits for the workers
        trio.run(drive, self.port, 20 * workers, 4, 100_000_000, "sleep 0")
        self.first_id = 1

    def measure(self, jobs: int, window: int, payload: str) -> tuple[float, float]:
        """(jobs/s, controller CPU seconds per job)."""
        cpu = process_cpu(self.proc.pid)
        rate, _ = trio.run(drive, self.port, jobs, window, self.next_id, payload)
        self.next_id += jobs
        return rate, (process_cpu(self.proc.pid) - cpu) / jobs

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def point(
    workers: int,
    length: float,
    journal: bool,
    protocol: str,
    rounds: int,
    seconds: float,
) -> dict[str, Any]:
    jobs = jobs_for(workers, length, seconds)
    window = max(64, 8 * workers)
    rates, cpus, ppe = [], [], []
    with socket_dir() as sockdir:
        ours = Ours(sockdir, workers, journal, protocol, HANDLER)
        try:
            for _ in range(rounds):
                rate, cpu = ours.measure(jobs, window, f"sleep {length}")
                rates.append(rate)
                cpus.append(cpu)
                ppe.append(ppe_rate(workers, length, jobs))
        finally:
            ours.close()
    row: dict[str, Any] = {
        "workers": workers,
        "length_ms": round(length * 1000, 3),
        "journal": journal,
        "protocol": protocol,
        "jobs": jobs,
        "jobs_per_s": round(median(rates)),
        "jobs_per_s_spread": [round(min(rates)), round(max(rates))],
        "ppe_jobs_per_s": round(median(ppe)),
        "ratio_to_ppe": round(median(rates) / median(ppe), 3),
        "controller_cpu_us": round(median(cpus) * 1e6, 1),
    }
    if length > 0:
        row["efficiency"] = round(work.efficiency(median(rates), workers, length), 3)
        row["ppe_efficiency"] = round(work.efficiency(median(ppe), workers, length), 3)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workers | job | protocol | jobs/s (spread) | ProcessPoolExecutor(n) | x PPE "
        "| efficiency (PPE) | controller CPU per job |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        job = "no-op" if r["length_ms"] == 0 else f"{r['length_ms']:g} ms"
        eff = f"{r['efficiency']:.2f} ({r['ppe_efficiency']:.2f})" if "efficiency" in r else ""
        low, high = r["jobs_per_s_spread"]
        lines.append(
            f"| {r['workers']} | {job} | {r['protocol']} | {r['jobs_per_s']:,} ({low:,}-{high:,}) "
            f"| {r['ppe_jobs_per_s']:,} | {r['ratio_to_ppe']:.2f} | {eff} "
            f"| {r['controller_cpu_us']:.0f} us |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- section 16's 2-CPU targets


def bare_true(count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        subprocess.run(["/usr/bin/true"], check=True)
    return count / (time.perf_counter() - start)


def targets(rounds: int) -> dict[str, Any]:
    """Each protocol in one run, in turns: the controller's CPU per no-op job (UDP,
    journal off, 2 workers), 1 ms jobs' efficiency on 2 workers, and `--exec true` with 4 in
    flight on one worker beside a bare subprocess.run loop."""
    out: dict[str, Any] = {}
    cases = [
        ("noop_2_workers", 2, HANDLER, "sleep 0", 6000, 64),
        ("sleep_1ms_2_workers", 2, HANDLER, "sleep 0.001", 2000, 64),
        ("exec_true_4_in_flight", 1, EXEC_TRUE, "", 600, 4),
    ]
    for name, workers, args, payload, jobs, window in cases:
        figures: dict[str, dict[str, list[float]]] = {}
        with socket_dir() as a, socket_dir() as b, socket_dir() as c:
            both = {
                protocol: Ours(sockdir, workers, False, protocol, args)
                for protocol, sockdir in zip(PROTOCOLS, (a, b, c), strict=True)
            }
            try:
                bare: list[float] = []
                for r in range(rounds):
                    order = list(PROTOCOLS)
                    order = order[r % 3 :] + order[: r % 3]  # each goes first in turn
                    for protocol in order:
                        rate, cpu = both[protocol].measure(jobs, window, payload)
                        got = figures.setdefault(protocol, {"rate": [], "cpu": []})
                        got["rate"].append(rate)
                        got["cpu"].append(cpu * 1e6)
                    if name.startswith("exec"):
                        bare.append(bare_true(jobs // 2))
            finally:
                for ours in both.values():
                    ours.close()
        result: dict[str, Any] = {}
        for protocol, got in figures.items():
            result[protocol] = {
                "jobs_per_s": round(median(got["rate"])),
                "jobs_per_s_all": [round(x) for x in got["rate"]],
                "controller_cpu_us": round(median(got["cpu"]), 1),
                "controller_cpu_us_all": [round(x, 1) for x in got["cpu"]],
            }
            if name.startswith("sleep"):
                result[protocol]["efficiency"] = round(
                    work.efficiency(median(got["rate"]), workers, 0.001), 3
                )
        if name.startswith("sleep"):
            ppe = [ppe_rate(2, 0.001, jobs) for _ in range(rounds)]
            result["ppe_efficiency"] = round(work.efficiency(median(ppe), 2, 0.001), 3)
        if name.startswith("exec"):
            result["bare_true_per_s"] = round(median(bare))
            for protocol in figures:
                result[protocol]["x_bare"] = round(
                    result[protocol]["jobs_per_s"] / result["bare_true_per_s"], 3
                )
        out[name] = result
        print(f"{name}: {json.dumps(result)}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    cpus = os.cpu_count() or 1
    parser.add_argument(
        "--workers",
        default=",".join(map(str, worker_counts(cpus))),
        help="worker counts, comma-separated (default: 1, 2, 4, ... up to the CPU count)",
    )
    parser.add_argument("--lengths-ms", default="0,1,10", help="job lengths in ms")
    parser.add_argument("--journal", default="off,on", help="off, on, or both: off,on")
    parser.add_argument(
        "--protocol",
        default="channel",
        help=f"comma-separated, of {', '.join(PROTOCOLS)} (default: channel)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=1.0, help="about how long a round")
    parser.add_argument("--json", type=Path, help="write the figures there too")
    parser.add_argument(
        "--plot",
        type=Path,
        default=Path(__file__).with_name("scale.png"),
        help="the plot of jobs/s against workers (default: bench/scale.png)",
    )
    parser.add_argument("--targets", action="store_true", help="section 16's 2-CPU targets")
    args = parser.parse_args(argv)
    with importable_bench():
        if args.targets:
            result: Any = targets(max(args.rounds, 3))
        else:
            counts = [int(x) for x in args.workers.split(",")]
            lengths = [float(x) / 1000 for x in args.lengths_ms.split(",")]
            journals = [j == "on" for j in args.journal.split(",")]
            protocols = args.protocol.split(",")
            unknown = [p for p in protocols if p not in PROTOCOLS]
            if unknown:
                parser.error(f"--protocol: unknown {', '.join(unknown)}")
            print(f"host: {cpus} CPUs; python {sys.version.split()[0]}", flush=True)
            result = []
            for journal in journals:
                rows = []
                for n in counts:
                    for length in lengths:
                        for protocol in protocols:
                            rows.append(
                                point(n, length, journal, protocol, args.rounds, args.seconds)
                            )
                            print(table(rows[-1:]).splitlines()[-1], flush=True)
                print(f"\njournal {'on' if journal else 'off'}:\n{table(rows)}\n", flush=True)
                result += rows
            from bench import plots  # matplotlib: only for the full table

            plots.scale(result, args.plot, cpus)
            print(f"plot: {args.plot}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
