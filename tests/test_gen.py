"""gen/ must be exactly what `make proto` produces from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gen_is_up_to_date(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            str(ROOT / "proto" / "worker_protocol.proto"),
        ],
        check=True,
    )
    for generated in tmp_path.iterdir():
        committed = ROOT / "gen" / generated.name
        assert committed.exists(), f"gen/{generated.name} missing: run make proto"
        assert committed.read_bytes() == generated.read_bytes(), (
            f"gen/{generated.name} is out of date with proto/: run make proto and commit gen/"
        )
