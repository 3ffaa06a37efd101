"""The packaging, read statically: the systemd units verify cleanly (`systemd-analyze verify`,
with ExecStart pointed at this venv) and promise what the controller and section 15 need, the
sysusers.d lines parse and make job users of their own, the packaged config names them and the
token file."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
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
        "ReadWritePaths=/run/controller",
        "StartLimitIntervalSec=0",
        "RestrictAddressFamilies=AF_UNIX\n",
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
    assert proc.returncode == 0 and "--workers N" in proc.stdout and "--job-users N" in proc.stdout
    proc = subprocess.run(["sh", str(script), "--bogus"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown option --bogus" in proc.stderr


def unit_lines(name: str, key: str) -> list[str]:
    """Every value `key=` is given in unit file `name`, in order."""
    prefix = key + "="
    text = (PACKAGING / name).read_text()
    return [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]


def test_worker_unit_starts_as_root_and_runs_jobs_as_its_slots_user():
    """Section 15: no User= (the worker switches itself with --user controller), each
    instance's jobs as controller-job-%i, only the capabilities to switch and to stop its
    jobs, a delegated cgroup that stays writable, and the system calls to switch allowed."""
    assert unit_lines("worker@.service", "User") == []
    assert unit_lines("worker@.service", "Group") == []
    (exec_start,) = unit_lines("worker@.service", "ExecStart")
    argv = exec_start.split()
    assert argv[argv.index("--user") + 1] == "controller"
    assert argv[argv.index("--job-user") + 1] == "controller-job-%i"
    assert argv[argv.index("--socket-dir") + 1] == "/run/controller"
    assert "--exec" not in argv and "--handler" not in argv
    (caps,) = unit_lines("worker@.service", "CapabilityBoundingSet")
    assert set(caps.split()) == {"CAP_SETUID", "CAP_SETGID", "CAP_KILL"}
    assert unit_lines("worker@.service", "AmbientCapabilities") == []
    assert unit_lines("worker@.service", "Delegate") == ["yes"]
    # ProtectControlGroups= would make the delegated cgroup read-only.
    assert unit_lines("worker@.service", "ProtectControlGroups") in ([], ["no"])
    filters = unit_lines("worker@.service", "SystemCallFilter")
    assert filters[:2] == ["@system-service", "~@privileged"]
    allowed_again = {word for line in filters[2:] for word in line.split()}
    assert {"@setuid", "capset"} <= allowed_again
    assert unit_lines("worker@.service", "NoNewPrivileges") == ["yes"]


def test_socket_directory_stays_the_controllers_group_alone():
    tmpfiles = (PACKAGING / "controller.tmpfiles").read_text()
    (line,) = [x for x in tmpfiles.splitlines() if x.startswith("d /run/controller ")]
    assert line.split()[2:5] == ["0770", "root", "controller"]
    assert unit_lines("controller.service", "RuntimeDirectoryMode") == ["0770"]
    assert unit_lines("controller.service", "Group") == ["controller"]


def test_packaged_config_names_the_job_users_and_the_token_file():
    packaged = json.loads((PACKAGING / "controller.json").read_text())
    assert packaged["job_users"] == "controller-job-{slot}"
    assert packaged["http_token_file"] == "/etc/controller/http-tokens"
    dev = json.loads((PACKAGING / "dev.json").read_text())
    # make run: jobs run as the developer's own user, no token needed.
    assert dev.get("job_users") is None and dev.get("http_token_file") is None


def job_users_text(highest: int) -> str:
    proc = subprocess.run(
        ["sh", str(PACKAGING / "job-users.sh"), str(highest)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_job_users_are_one_a_slot_with_no_home_no_shell_and_no_other_group():
    text = job_users_text(3)
    entries = [line.split('"') for line in text.splitlines() if not line.startswith("#")]
    assert len(entries) == 4
    for slot, (head, _gecos, tail) in enumerate(entries):
        assert head.split() == ["u", f"controller-job-{slot}", "-"]
        assert tail.split() == ["/", "/usr/sbin/nologin"]
    # No membership lines: each job user is in its own group and no other.
    assert not re.search(r"^[mr] ", text, re.MULTILINE)
    # The packaged config's pattern names these users.
    pattern = json.loads((PACKAGING / "controller.json").read_text())["job_users"]
    assert f"u {pattern.replace('{slot}', '3')} " in text
    for bad in ("", "x", "-1"):
        proc = subprocess.run(["sh", str(PACKAGING / "job-users.sh"), bad], capture_output=True)
        assert proc.returncode == 2


@pytest.mark.skipif(
    shutil.which("systemd-sysusers") is None, reason="systemd-sysusers not installed"
)
def test_job_users_entries_parse(tmp_path):
    conf = tmp_path / "controller-jobs.conf"
    conf.write_text(job_users_text(1))
    proc = subprocess.run(
        ["systemd-sysusers", "--dry-run", str(conf)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "not a valid" not in proc.stderr and "rror" not in proc.stderr
    assert "Creating user 'controller-job-1'" in proc.stderr + proc.stdout


def test_delegate_cgroup_hands_over_only_a_worker_units_own_cgroup():
    """worker@.service's ExecStartPre= runs it as root; outside a worker@ unit's cgroup (here)
    it changes nothing and succeeds, and it names what it needs when called wrong."""
    script = PACKAGING / "delegate-cgroup.sh"
    (pre,) = unit_lines("worker@.service", "ExecStartPre")
    assert pre == "+/bin/sh /opt/job-controller/packaging/delegate-cgroup.sh controller"
    own = Path("/proc/self/cgroup").read_text()
    if "/worker@" not in own:
        proc = subprocess.run(["sh", str(script), "controller"], capture_output=True, text=True)
        assert proc.returncode == 0 and proc.stdout == proc.stderr == ""
    proc = subprocess.run(["sh", str(script)], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_the_wheel_holds_every_module_and_the_console_files(tmp_path):
    """A package folder the build leaves out would install a controller that cannot start.
    Built from a copy, so that no `build/` left in the checkout adds or hides a file."""
    root = PACKAGING.parent
    source = tmp_path / "source"
    for top in ("controller", "worker", "gen"):
        shutil.copytree(root / top, source / top, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, source / name)
    wanted = {
        str(path.relative_to(source))
        for path in source.rglob("*")
        if path.is_file()
        and (path.suffix in (".py", ".pyi", ".css", ".js") or path.name == "py.typed")
    }
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    proc = subprocess.run([*pip, "-w", str(tmp_path), str(source)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("*.whl")
    names = {n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n}
    assert names == wanted
