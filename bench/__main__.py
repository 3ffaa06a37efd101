"""`make bench`: every benchmark, its figures beside its baseline, and bench/results.json."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

from bench import controller_bench, e2e_bench, worker_bench


def main() -> None:
    results = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}",
        "controller": controller_bench.main(),
        "worker": worker_bench.main(),
        "end_to_end": e2e_bench.main(),
    }
    path = Path(__file__).parent / "results.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"written {path}")


main()
