"""The systemd units verify cleanly (`systemd-analyze verify`), with ExecStart pointed at this venv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGING = Path(__file__).resolve().parent.parent / "packaging"
UNITS = ["controller.service", "worker@.service", "workers.target"]


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None and not os.environ.get("CI"),
    reason="systemd-analyze not installed (.ci/run installs it)",
)
def test_units_verify(tmp_path):
    bindir = Path(sys.executable).parent
    for name in UNITS:
        text = (PACKAGING / name).read_text()
        (tmp_path / name).write_text(text.replace("/opt/job-controller/.venv/bin", str(bindir)))
    proc = subprocess.run(
        ["systemd-analyze", "verify", *UNITS], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr


def test_units_promise_what_the_controller_needs():
    controller = (PACKAGING / "controller.service").read_text()
    for line in [
        "Type=notify",
        "NotifyAccess=main",
        "WatchdogSec=",
        "RuntimeDirectory=controller",
        "StateDirectory=controller",
        "ConfigurationDirectory=controller",
        "Restart=on-failure",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
    ]:
        assert line in controller
    for line in [
        # Workers create their sockets in the socket directory: it is the group's to write.
        "RuntimeDirectoryMode=0770",
        "UMask=0077",
        "StateDirectoryMode=0700",
        "ConfigurationDirectoryMode=0700",
        "LimitNOFILE=65536",
        "CapabilityBoundingSet=\n",
    ]:
        assert line in controller
    worker = (PACKAGING / "worker@.service").read_text()
    for line in [
        "Restart=always",
        "User=controller",
        "ReadWritePaths=/run/controller",
        "StartLimitIntervalSec=0",
        "RestrictAddressFamilies=AF_UNIX\n",
        "CapabilityBoundingSet=\n",
    ]:
        assert line in worker
    tmpfiles = (PACKAGING / "controller.tmpfiles").read_text()
    assert "d /run/controller 0770 root controller -" in tmpfiles
    assert "/etc/controller/controller.json" in controller
    assert (PACKAGING / "controller.json").exists()


@pytest.mark.skipif(
    shutil.which("systemd-sysusers") is None, reason="systemd-sysusers not installed"
)
def test_sysusers_entry_parses():
    proc = subprocess.run(
        ["systemd-sysusers", "--dry-run", str(PACKAGING / "controller.sysusers")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Failed" not in proc.stderr and "rror" not in proc.stderr


def test_install_script_parses_and_answers_help_and_unknown_options():
    script = PACKAGING / "install.sh"
    assert subprocess.run(["sh", "-n", str(script)]).returncode == 0
    proc = subprocess.run(["sh", str(script), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "--workers N" in proc.stdout
    proc = subprocess.run(["sh", str(script), "--bogus"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown option --bogus" in proc.stderr
