"""`udp-client`: submit jobs to the controller's UDP front door."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("udp-client: not implemented yet", file=sys.stderr)
    return 2
