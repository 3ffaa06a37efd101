"""SYSTEMD: the packaged units under a real systemd, installed by packaging/install.sh.

Boots systemd (the host's /lib/systemd/systemd) as PID 1 of new Linux namespaces
(tests/systemd_boot.sh: private mounts, overlays over /etc, /var and /opt, its own
tmpfs on /tmp and /run, loopback-only network, its own cgroup), installs the product
there offline from a wheelhouse built on the host side, and checks what an operator
relies on: READY, workers registered, a job answered, STATUS= in `systemctl status`,
the watchdog restarting a stopped controller without losing a job, a worker killed
six times in ten seconds coming back, and the `systemd-analyze security` exposures
(printed). And section 15's packaging: the job users exist (a group of their own each,
no other, no shell), the token file is 0600 root and `jobctl list` uses it by default
while another user is refused, an `--exec` job runs as its slot's user and can neither
list /run/controller nor reach main.sock. Root only, and only where namespaces can be
made; skipped with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import wait_for_condition

ROOT = Path(__file__).resolve().parent.parent
BOOT = Path(__file__).resolve().parent / "systemd_boot.sh"
SYSTEMD = Path("/lib/systemd/systemd")
# Everything the boot does, from unshare to poweroff, is killed past this bound.
BOOT_BOUND = 240
# No step inside may take longer than this.
STEP_BOUND = 120
PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


def why_not() -> str | None:
    """Why this machine cannot run the test, or None."""
    if not sys.platform.startswith("linux"):
        return "needs Linux"
    if os.geteuid() != 0:
        return "needs root (boots systemd in Linux namespaces)"
    if not SYSTEMD.exists():
        return f"no {SYSTEMD} (apt-get install systemd)"
    for tool in ("unshare", "nsenter", "findmnt", "ip", "timeout"):
        if shutil.which(tool) is None:
            return f"no {tool} (apt-get install util-linux iproute2 coreutils)"
    if not Path("/usr/bin/python3").exists():
        return "no /usr/bin/python3 for the installed venv"
    if cgroup2_root() is None:
        return "no writable cgroup2 hierarchy"
    probe = subprocess.run(
        [
            "timeout",
            "-s",
            "KILL",
            "20",
            "unshare",
            "--fork",
            "--pid",
            "--mount",
            "--net",
            "--cgroup",
            "--propagation",
            "private",
            "true",
        ],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"cannot make namespaces here: {probe.stderr.strip()}"
    return None


def cgroup2_root() -> Path | None:
    for path in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
        if (
            (path / "cgroup.procs").exists()
            and (path / "cgroup.controllers").exists()
            and os.access(path, os.W_OK)
        ):
            return path
    return None


REASON = why_not()
pytestmark = [
    pytest.mark.systemd,
    pytest.mark.skipif(REASON is not None, reason=f"systemd test: {REASON}"),
]


class Machine:
    """A booted systemd in namespaces, reached with nsenter."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def command(self, argv: tuple[str, ...], bound: float) -> list[str]:
        """`argv` inside every namespace of the machine, with a clean environment, killed
        after `bound` seconds."""
        enter = ["nsenter", "-t", str(self.pid), "-m", "-u", "-i", "-n", "-p", "-C", "--"]
        return ["timeout", "-s", "KILL", str(bound), *enter, "env", "-i", f"PATH={PATH}", *argv]

    def run(self, *argv: str, bound: float = 30, check: bool = True) -> str:
        proc = subprocess.run(self.command(argv, bound), capture_output=True, text=True)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
            )
        return proc.stdout + proc.stderr if not check else proc.stdout

    def ok(self, *argv: str) -> bool:
        return subprocess.run(self.command(argv, 30), capture_output=True).returncode == 0

    def start(self, *argv: str, bound: float = 60) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.command(argv, bound), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def show(self, unit: str) -> dict[str, str]:
        text = self.run(
            "systemctl",
            "show",
            unit,
            "-p",
            "ActiveState,SubState,StatusText,MainPID,NRestarts,Result",
        )
        return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)

    def journal(self, unit: str) -> str:
        return self.run("journalctl", "--no-pager", "-n", "40", "-u", unit, check=False)


def descendants(pid: int) -> list[int]:
    found: list[int] = []
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                kids = (task / "children").read_text().split()
                found.extend(int(k) for k in kids)
                todo.extend(int(k) for k in kids)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def project_copy(into: Path) -> None:
    """The worktree as a clone would have it: tracked and new files, nothing ignored."""
    files = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            dst = into / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def wheelhouse(into: Path) -> None:
    """The product's dependencies and its build backend as wheels for the system Python
    (pip runs as that Python, so its markers hold; the pip cache serves the files), so
    that install.sh installs with no network inside."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        needs = tomllib.load(f)["project"]["dependencies"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            "/usr/bin/python3",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--only-binary=:all:",
            "-d",
            str(into),
            *needs,
            "setuptools>=77",
        ],
        capture_output=True,
        text=True,
        timeout=STEP_BOUND,
    )
    assert proc.returncode == 0, proc.stderr


@pytest.fixture
def machine() -> Iterator[Machine]:
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="jc-systemd-"))
    cgroup = cgroup2_root()
    assert cgroup is not None
    group = cgroup / f"jctest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    marker = work.name + ".marker"
    marker_path = Path(tempfile.gettempdir()) / marker
    boot = None
    try:
        (work / "stage").mkdir()
        (work / "clone").mkdir()
        (work / "wheels").mkdir()
        project_copy(work / "clone")
        wheelhouse(work / "wheels")
        marker_path.write_text("the host's /tmp: must not be visible inside\n")
        group.mkdir()
        env = {
            "PATH": PATH,
            "JC_STAGE": str(work / "stage"),
            "JC_CLONE": str(work / "clone"),
            "JC_WHEELS": str(work / "wheels"),
            "JC_MARKER": marker,
        }
        # Its own process group and cgroup; everything under a hard bound.
        script = (
            f"echo $$ > {group}/cgroup.procs && exec timeout -s KILL {BOOT_BOUND} "
            "unshare --fork --kill-child --pid --mount --uts --ipc --net --cgroup "
            f"--propagation private sh {BOOT}"
        )
        boot = subprocess.Popen(
            ["sh", "-c", script],
            env=env,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert boot.stdout is not None
        first = boot.stdout.readline()
        assert first.strip() == "jctest: /tmp and /run are private tmpfs", (
            first + boot.stdout.read()
        )

        def systemd_pid() -> int | None:
            for pid in descendants(boot.pid):
                try:
                    if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd":
                        return pid
                except FileNotFoundError:
                    continue
            return None

        wait_for_condition(lambda: systemd_pid() is not None, timeout=30)
        pid = systemd_pid()
        assert pid is not None
        box = Machine(pid)
        # Inside, /tmp must not be the host's: the marker stays invisible.
        assert box.run("findmnt", "-n", "-o", "FSTYPE", "--mountpoint", "/tmp").strip() == "tmpfs"
        assert box.run("ls", "-A", "/tmp").split().count(marker) == 0
        wait_for_condition(lambda: box.ok("test", "-S", "/run/systemd/private"), timeout=30)
        state = box.run("systemctl", "is-system-running", "--wait", bound=60, check=False)
        print(f"systemd booted ({state.strip()}) in {time.monotonic() - started:.1f} s")
        yield box
        box.run(
            "systemctl",
            "start",
            "--job-mode=replace-irreversibly",
            "--no-block",
            "poweroff.target",
            check=False,
        )
        with contextlib.suppress(subprocess.TimeoutExpired):
            boot.wait(timeout=15)
    finally:
        if boot is not None:
            if boot.poll() is None:
                os.killpg(boot.pid, signal.SIGKILL)
            boot.wait()
            if boot.stdout is not None:
                boot.stdout.close()
        if group.exists():
            remove_cgroup(group)
        marker_path.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
        print(f"systemd test: {time.monotonic() - started:.1f} s from setup to cleanup")


def remove_cgroup(group: Path) -> None:
    """Kill whatever is left in the test's cgroup, then remove it and what systemd made in it."""
    kill = group / "cgroup.kill"
    if kill.exists():
        kill.write_text("1")
    wait_for_condition(lambda: no_procs(group), 10)
    for sub in sorted((p for p in group.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        sub.rmdir()
    group.rmdir()


def no_procs(group: Path) -> bool:
    return all(not p.read_text().strip() for p in group.rglob("cgroup.procs"))


EXPOSURE = re.compile(r"Overall exposure level for (\S+): ([0-9.]+)")


def exposure(box: Machine, unit: str) -> float:
    text = box.run("systemd-analyze", "security", "--no-pager", unit)
    found = EXPOSURE.search(text)
    assert found, text
    return float(found.group(2))


def test_installed_units_serve_under_real_systemd(machine: Machine):
    box = machine
    t0 = time.monotonic()
    install = [
        "sh",
        "/opt/jc-clone/packaging/install.sh",
        "--workers",
        "2",
        "--wheels",
        "/opt/jc-wheels",
    ]
    out = box.run(*install, bound=STEP_BOUND)
    print(out)
    print(f"install.sh: {time.monotonic() - t0:.1f} s")
    # Safe to run twice: the config is kept, nothing fails, the controller serves again.
    again = box.run(*install, bound=STEP_BOUND)
    assert "keeping the existing /etc/controller/controller.json" in again
    assert "keeping the existing token file /etc/controller/http-tokens" in again

    def ready(want_workers: int = 2) -> bool:
        s = box.show("controller.service")
        return (
            s.get("ActiveState") == "active"
            and s.get("SubState") == "running"
            and s.get("StatusText", "").startswith(f"{want_workers} workers")
        )

    try:
        wait_for_condition(ready, timeout=30)
    except AssertionError:
        raise AssertionError(
            box.run("systemctl", "status", "--no-pager", "controller", "worker@1", check=False)
            + box.journal("controller")
            + box.journal("worker@1")
        ) from None
    status = box.run("systemctl", "status", "--no-pager", "controller.service", check=False)
    assert re.search(r"Status: \"2 workers", status), status

    # Modes: workers create their sockets in the socket directory; secrets and the journal
    # are root's alone.
    modes = box.run(
        "stat",
        "-c",
        "%n %a %U:%G",
        "/run/controller",
        "/etc/controller",
        "/etc/controller/controller.json",
        "/var/lib/controller",
        "/var/lib/controller/journal.sqlite3",
    )
    print(modes)
    assert "/run/controller 770 root:controller" in modes
    assert "/etc/controller 700 root:root" in modes
    assert "/etc/controller/controller.json 600 root:root" in modes
    assert "/var/lib/controller 700 root:" in modes
    assert re.search(r"journal.sqlite3 600 root:", modes), modes

    client = "/opt/job-controller/.venv/bin/udp-client"
    assert box.run(client, "--timeout", "20", "add", "5", "--payload", "hi").strip() == "hi"

    check_job_users(box, highest=2)
    check_token_file(box)

    # The watchdog: a stopped controller is killed and started again; a job submitted while it
    # is stopped is answered by the next one.
    before = box.show("controller.service")
    box.run("systemctl", "kill", "-s", "SIGSTOP", "--kill-who=main", "controller.service")
    t_stop = time.monotonic()
    around = box.start(client, "--timeout", "90", "add", "6", "--payload", "around", bound=100)
    wait_for_condition(
        lambda: box.show("controller.service").get("MainPID") not in ("0", before["MainPID"]),
        timeout=60,
    )
    out, err = around.communicate(timeout=100)
    assert around.returncode == 0 and out.strip() == "around", (
        out + err + box.journal("controller") + box.journal("worker@1")
    )
    wait_for_condition(ready, timeout=30)
    after = box.show("controller.service")
    print(f"watchdog restart: job answered {time.monotonic() - t_stop:.1f} s after SIGSTOP")
    assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1
    assert "watchdog" in box.journal("controller").lower()

    # A worker killed six times within ten seconds comes back: no start limit leaves it failed.
    def restarted(old: str) -> bool:
        return box.show("worker@1.service").get("MainPID") not in ("0", old)

    t_kill = time.monotonic()
    for _ in range(6):
        old = box.show("worker@1.service")["MainPID"]
        box.run("systemctl", "kill", "-s", "SIGKILL", "worker@1.service")
        wait_for_condition(functools.partial(restarted, old), timeout=15)
    print(f"worker@1 killed 6 times and back each time in {time.monotonic() - t_kill:.1f} s")
    wait_for_condition(lambda: box.show("worker@1.service")["ActiveState"] == "active", 15)
    wait_for_condition(ready, timeout=30)
    assert box.run(client, "--timeout", "20", "add", "7", "--payload", "back").strip() == "back"

    scores = {unit: exposure(box, unit) for unit in ("controller.service", "worker@1.service")}
    for unit, score in scores.items():
        print(f"systemd-analyze security {unit}: exposure {score}")

    # Run again with fewer workers: the ones above the number are stopped and disabled.
    fewer = box.run(*install[:3], "1", *install[4:], bound=STEP_BOUND)
    assert "retiring worker@2.service" in fewer
    assert box.run("systemctl", "is-enabled", "worker@2.service", check=False).startswith(
        "disabled"
    )
    wait_for_condition(functools.partial(ready, 1), timeout=30)

    check_jobs_run_as_the_slots_user(box, lambda: ready(1))
    print(f"systemd test body: {time.monotonic() - t0:.1f} s")


def check_job_users(box: Machine, highest: int) -> None:
    """controller-job-0 ... controller-job-HIGHEST: system users, a group of their own and
    no other (never `controller`), no home, no shell."""
    for slot in range(highest + 1):
        name = f"controller-job-{slot}"
        entry = box.run("getent", "passwd", name).strip().split(":")
        assert entry[0] == name and entry[5] == "/" and entry[6] == "/usr/sbin/nologin", entry
        assert 0 < int(entry[2]) < 1000, entry
        assert box.run("id", "-nG", name).split() == [name]
    members = box.run("getent", "group", "controller").strip().split(":")[3]
    assert "controller-job" not in members, members
    print(f"job users controller-job-0 ... controller-job-{highest}: own group alone, nologin")


def check_token_file(box: Machine) -> None:
    """The packaged token file: 0600 root; jobctl as root reads it by default, another user
    (who cannot read it) is refused."""
    assert box.run("stat", "-c", "%a %U:%G", "/etc/controller/http-tokens").split() == [
        "600",
        "root:root",
    ]
    jobctl = "/opt/job-controller/.venv/bin/jobctl"
    listed = json.loads(box.run(jobctl, "list", "--json"))
    assert listed, listed
    nobody = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--")
    refused = subprocess.run(
        box.command((*nobody, jobctl, "queues"), 30), capture_output=True, text=True
    )
    assert refused.returncode == 1 and "401" in refused.stderr, refused
    print("token file 0600 root:root; jobctl list as root: ok; as nobody: 401")


# An --exec job that reports who it runs as and whether it reaches the socket directory.
WHOAMI = """\
import os, socket, sys
sys.stdin.buffer.read()
out = [f"uid={os.getuid()}", f"euid={os.geteuid()}", f"gid={os.getgid()}"]
out.append("groups=" + ",".join(str(g) for g in sorted(os.getgroups())))
try:
    os.listdir("/run/controller")
    out.append("list=ok")
except OSError as exc:
    out.append(f"list={exc.errno}")
try:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect("/run/controller/main.sock")
    out.append("connect=ok")
except OSError as exc:
    out.append(f"connect={exc.errno}")
writable = []
for d in ("/tmp", "/var/tmp", "/dev/shm", "/opt", "/etc", "/var/lib", "/run", "/usr", "/"):
    probe = os.path.join(d, f"jc-probe-{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.unlink(probe)
        writable.append(d)
    except OSError:
        pass
out.append("writable=" + ",".join(writable))
others = 0
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        others += os.stat(f"/proc/{pid}").st_uid != os.getuid()
    except OSError:
        pass
out.append(f"others_seen={others}")
try:
    socket.socket(socket.AF_INET).close()
    out.append("inet=ok")
except OSError as exc:
    out.append(f"inet={exc.errno}")
print(" ".join(out))
"""

EXEC_DROP_IN = """\
[Service]
ExecStart=
ExecStart=/opt/job-controller/.venv/bin/worker --socket-dir /run/controller --user controller \
--job-user controller-job-%i --exec /usr/bin/python3 /opt/jc-whoami.py
"""


def check_jobs_run_as_the_slots_user(box: Machine, ready: Callable[[], bool]) -> None:
    """With the documented drop-in giving worker@1 an --exec command, a job runs as
    controller-job-1 (uid and gid, no supplementary group) and cannot list /run/controller or
    connect to main.sock (EACCES)."""
    box.run("sh", "-c", f"cat > /opt/jc-whoami.py <<'EOF'\n{WHOAMI}EOF\n")
    box.run("chmod", "0644", "/opt/jc-whoami.py")
    box.run("mkdir", "-p", "/etc/systemd/system/worker@.service.d")
    box.run(
        "sh",
        "-c",
        f"cat > /etc/systemd/system/worker@.service.d/exec.conf <<'EOF'\n{EXEC_DROP_IN}EOF\n",
    )
    box.run("systemctl", "daemon-reload")
    box.run("systemctl", "restart", "worker@1.service")
    try:
        wait_for_condition(ready, timeout=30)
    except AssertionError:
        raise AssertionError(box.journal("worker@1")) from None
    client = "/opt/job-controller/.venv/bin/udp-client"
    try:
        answer = box.run(client, "--timeout", "20", "add", "9", "--payload", "who").strip()
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{box.journal('worker@1')}") from None
    print(f"an --exec job of worker@1 says: {answer}")
    journal = box.journal("worker@1")
    assert "jobs run as controller-job-1" in journal, journal
    assert re.search(r"limits: (setrlimit|cgroup v2 /)", journal), journal
    # The delegated cgroup is the worker's (delegate-cgroup.sh), as with User=.
    own = box.run("systemctl", "show", "-p", "ControlGroup", "--value", "worker@1.service")
    owner = box.run("stat", "-c", "%U", f"/sys/fs/cgroup{own.strip()}").strip()
    assert owner == "controller", (own, owner)
    seen = dict(item.split("=", 1) for item in answer.split())
    uid = box.run("id", "-u", "controller-job-1").strip()
    gid = box.run("id", "-g", "controller-job-1").strip()
    assert seen["uid"] == seen["euid"] == uid, answer
    assert seen["gid"] == gid and seen["groups"] in ("", gid), answer
    assert seen["list"] == str(errno.EACCES) and seen["connect"] == str(errno.EACCES), answer
    # The unit's sandbox holds for its jobs: a private /tmp, no other user's process, no
    # network socket.
    assert set(seen["writable"].split(",")) <= {"/tmp", "/var/tmp", "/dev/shm"}, answer
    assert seen["others_seen"] == "0", answer
    assert seen["inet"] != "ok", answer
