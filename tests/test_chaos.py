"""The short chaos run: every fault at once for about 25 s; nothing acknowledged may be lost."""

from __future__ import annotations

import subprocess
import sys


def test_short_chaos_run_loses_nothing(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.chaos", "--seconds", "25", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS: nothing acknowledged was lost" in proc.stdout
    assert "acknowledged tasks lost: 0" in proc.stdout
