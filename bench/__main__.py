"""`make bench`: every benchmark, its figures beside its baseline, bench/results.json and PNG plots."""

from __future__ import annotations

import json
import logging
import platform
import time
from pathlib import Path

from bench import (
    bulk_bench,
    controller_bench,
    e2e_bench,
    failure_bench,
    floor,
    http_bench,
    placement_bench,
    plots,
    redis_bench,
    remote_bench,
    speed_bench,
    worker_bench,
)

HERE = Path(__file__).parent


def main() -> None:
    logging.disable(logging.WARNING)  # the controllers under test log their faults on purpose
    results: dict[str, object] = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}",
    }
    results["controller"] = controller_bench.main()
    print("controller, tasks queued at once (100 fake workers):")
    results["queued"] = controller_bench.bench_queued()
    results["placement"] = placement_bench.main()
    results["worker"] = worker_bench.main()
    results["end_to_end"] = e2e_bench.main()
    results["window"] = e2e_bench.window_main()
    results["speed"] = speed_bench.main()
    results["floor"] = floor.main()
    results["http"] = http_bench.main()
    results["bulk"] = bulk_bench.main()
    results["remote"] = remote_bench.main()
    results["redis"] = redis_bench.main()
    results["journal"] = e2e_bench.journal_main()
    print("end to end against worker count:")
    scaling = e2e_bench.scaling()
    results["scaling"] = scaling
    samples = e2e_bench.latency_samples()
    results["failure"] = failure_bench.main()
    plots.throughput(scaling, HERE / "throughput.png")
    plots.latency(samples, HERE / "latency.png")
    (HERE / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"written {HERE / 'results.json'}, {HERE / 'throughput.png'}, {HERE / 'latency.png'}")


main()
