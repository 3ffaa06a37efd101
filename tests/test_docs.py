"""The documents stay true: links resolve, paths named by --help exist, the README's examples
run against a real controller, and the configuration reference matches controller/config.py.

The README's examples use the addresses `make run` serves (UDP 127.0.0.1:5555, HTTP
127.0.0.1:8080) and a redis-server on 127.0.0.1:6379. The tests start their own controller
and redis-server on free ports and rewrite those addresses in each example before running it
(`localize`); nothing else in an example is changed.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.config import Config, RedisSettings, parse_config
from tests.helpers import REDIS_SERVER, live_controller, redis_server, wait_for_condition

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
DOCUMENTS = [README, ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *DOCS]

FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```$", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def prose(text: str) -> str:
    """The text without its fenced code blocks (links there are code, not links)."""
    return FENCE.sub("", text)


def anchors(markdown: Path) -> set[str]:
    """The anchors GitHub makes for a file's headings."""
    found = set()
    for line in prose(markdown.read_text()).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
            found.add(slug)
    return found


# ---------------------------------------------------------------- links and paths


@pytest.mark.parametrize("document", DOCUMENTS, ids=rel)
def test_every_relative_link_resolves(document: Path) -> None:
    broken = []
    for target in LINK.findall(prose(document.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        path = (document.parent / path_part).resolve() if path_part else document
        if not path.exists() or (anchor and anchor not in anchors(path)):
            broken.append(target)
    assert broken == [], f"{rel(document)} links to what does not exist: {broken}"


def test_docs_stand_alone() -> None:
    """No document sends the reader outside the repository or narrates its making."""
    outside = re.compile(
        r"DESIGN\.md|design-notes|seeds/|section \d+ of the contract|contract's"
        r"|(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|this|that|same) session"
        r"|(?-i:\bruns? [ABC]\b|\b[AB], [BC]:)|this round",
        re.I,
    )
    for path in [
        *DOCUMENTS,
        ROOT / "proto" / "worker_protocol.proto",
        *(ROOT / "bench").glob("*.py"),
    ]:
        if path.name == "chaos.py":
            continue  # its "round" is a round of the fault loop ("a job of this round")
        found = outside.findall(path.read_text())
        assert found == [], f"{rel(path)} mentions {found}"


def test_readme_is_short_and_shows_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 220
    assert "make run" in text
    assert "make test" in text


HELP_COMMANDS = {
    "controller": ["-m", "controller"],
    "worker": ["-m", "worker"],
    "udp-client": ["-m", "controller.client"],
    "udp-client add": ["-m", "controller.client", "add"],
    "udp-client status": ["-m", "controller.client", "status"],
    "jobctl": ["-m", "controller.client.jobctl"],
    "jobctl list": ["-m", "controller.client.jobctl", "list"],
    "jobctl retry": ["-m", "controller.client.jobctl", "retry"],
    "jobctl output": ["-m", "controller.client.jobctl", "output"],
}
REPO_PATH = re.compile(r"(?<![\w/.])((?:docs|packaging|bench|proto|controller|worker)/[\w./@-]*\w)")


def help_text(command: str) -> str:
    if command == "install.sh":
        argv = ["sh", str(ROOT / "packaging" / "install.sh"), "--help"]
    else:
        argv = [sys.executable, *HELP_COMMANDS[command], "--help"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout


@pytest.mark.parametrize("command", [*HELP_COMMANDS, "install.sh"])
def test_every_option_in_help_is_documented(command: str) -> None:
    """Each flag a command's --help offers is named in the README or docs/."""
    docs = "\n".join(path.read_text() for path in [README, *DOCS])
    options = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", help_text(command))) - {"--help"}
    assert options, f"no options found in `{command} --help`"
    missing = sorted(o for o in options if not re.search(rf"{o}(?![a-z-])", docs))
    assert missing == [], f"`{command} --help` offers options no document names: {missing}"


@pytest.mark.parametrize("command", HELP_COMMANDS)
def test_paths_named_by_help_exist(command: str) -> None:
    text = help_text(command)
    named = REPO_PATH.findall(" ".join(text.split()))  # argparse wraps lines anywhere
    missing = [path for path in named if not (ROOT / path).exists()]
    assert missing == [], f"`{command} --help` names files that do not exist: {missing}"


def test_architecture_names_every_module_and_nothing_else() -> None:
    """docs/architecture.md is the map of the code: every module of controller/ and worker/
    (package __init__.py files aside) is named there by its full path, and every path it
    names (a module or a package folder) exists."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(REPO_PATH.findall(text))
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert missing == [], f"docs/architecture.md names what does not exist: {missing}"
    modules = {
        rel(path)
        for package in ("controller", "worker")
        for path in (ROOT / package).rglob("*.py")
        if path.name != "__init__.py"
    }
    unnamed = sorted(modules - named)
    assert unnamed == [], f"docs/architecture.md does not name these modules: {unnamed}"


# ---------------------------------------------------------------- the configuration reference


def documented_config() -> dict[str, object]:
    """The JSON block of docs/operations.md's "Configuration" section."""
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    match = FENCE.search(section)
    assert match is not None and match.group(1) == "json"
    value = json.loads(match.group(2))
    assert isinstance(value, dict)
    return value


def test_every_config_key_is_documented_with_its_default() -> None:
    documented = documented_config()
    accepted = {f.name for f in dataclasses.fields(Config)}
    assert accepted - set(documented) == set(), "config keys missing from docs/operations.md"
    assert set(documented) - accepted == set(), "documented keys config.py does not know"
    assert parse_config(documented, "docs/operations.md") == Config()


def test_every_documented_config_key_is_explained() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    for key in documented_config():
        assert f"\n- `{key}`:" in text, f"docs/operations.md does not explain {key}"


def test_redis_members_are_documented_with_their_defaults() -> None:
    text = (ROOT / "docs" / "redis.md").read_text()
    for member in dataclasses.fields(RedisSettings):
        default = member.default
        shown = (
            "null" if default is None else f"{default:g}" if isinstance(default, float) else default
        )
        assert (
            f"| `{member.name}` | {shown} |" in text or f"| `{member.name}` | `{shown}` |" in text
        )


def test_make_run_serves_the_addresses_the_readme_uses() -> None:
    dev = json.loads((ROOT / "packaging" / "dev.json").read_text())
    assert dev["client_address"] == {"host": "127.0.0.1", "port": 5555}
    assert dev["http_address"] == {"host": "127.0.0.1", "port": 8080}
    assert "--config packaging/dev.json" in (ROOT / "Makefile").read_text()


def test_udp_error_codes_are_documented() -> None:
    """Every error code the UDP door or a calculator can answer is in docs/protocol.md."""
    table = (ROOT / "docs" / "protocol.md").read_text().split("### Error codes", 1)[1]
    documented = set(re.findall(r"`(\w+)`", table.split("\n#", 1)[0]))
    sources = [*(ROOT / "controller").rglob("*.py"), *(ROOT / "worker").rglob("*.py")]
    code = "\n".join(path.read_text() for path in sources)
    literal = set(re.findall(r"(?:BadPacket\(|error_ack\(\w+, )\s*\"(\w+)\"", code))
    per_field = {f"{kind}_{name}" for kind in ("bad",) for name in ("payload", "result")}
    per_field |= {f"{name}_too_large" for name in ("payload", "result")}
    assert literal, "no error codes found in the code"
    assert (literal | per_field) - documented == set()


def test_udp_and_http_limits_are_the_documented_ones() -> None:
    """The figures docs/protocol.md, docs/http-api.md and the CHANGELOG give are the code's."""
    from controller import datagram as dg
    from controller.doors.http.shell import IDLE_TIMEOUT

    def words(path: str) -> str:  # the text with its line breaks undone
        return " ".join((ROOT / path).read_text().split())

    protocol = words("docs/protocol.md")
    for figure in (
        f"up to {dg.MAX_LITERAL:,} bytes",
        f"at most {dg.MAX_CHUNK:,} bytes of result a request",
        f"never more than {dg.MAX_STATUS:,} bytes",
        f"over {dg.MAX_INLINE_RESULT:,} bytes encoded",
        f"the first repeat after {dg.RESEND_FIRST:g} s, the wait doubling up to "
        f"{dg.RESEND_MAX:g} s, at most {dg.RESEND_COUNT} repeats",
    ):
        assert figure in protocol, f"docs/protocol.md does not say {figure!r}"
    changelog = words("CHANGELOG.md")
    assert f"`get_result` answers at most {dg.MAX_CHUNK:,} bytes of result" in changelog
    http = words("docs/http-api.md")
    assert f"paused for {IDLE_TIMEOUT:g} s" in http
    assert f"A connection silent for {IDLE_TIMEOUT:g} s is closed" in http


def test_metric_names_are_the_ones_exported() -> None:
    code = (ROOT / "controller" / "shell" / "metrics.py").read_text()
    exported = set(re.findall(r'"(controller_\w+)"', code))
    docs = "\n".join(path.read_text() for path in [README, *DOCS])
    metric = re.compile(r"(?<![.\w])controller_(?!bench\b)\w+")  # not bench's controller_bench
    named = {re.sub(r"_total$", "", name) for name in metric.findall(docs)}
    operations = (ROOT / "docs" / "operations.md").read_text()
    in_operations = {re.sub(r"_total$", "", name) for name in metric.findall(operations)}
    assert named <= exported, "documents name metrics that are not exported"
    assert in_operations == exported, "docs/operations.md does not list every metric"


# ---------------------------------------------------------------- the README's examples


def readme_blocks() -> list[tuple[str, str]]:
    """(language, code) of every fenced block in the README."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(README.read_text())]


def block(first_words: str) -> str:
    """The README block whose first line starts with `first_words`."""
    found = [code for _, code in readme_blocks() if code.startswith(first_words)]
    assert len(found) == 1, f"expected one README block starting {first_words!r}"
    return found[0]


# Every README block is either run below or listed here with the reason it is not.
NOT_RUN = {
    "make run": "the set-up itself; the tests start an equivalent controller",
    ".venv/bin/controller --config": "needs the reader's own ./job.sh and mypkg",
    "packaging/install.sh": "installs a system service as root (tests/test_systemd.py)",
}
RUN = {
    ".venv/bin/udp-client add 5",
    "curl -si -XPOST",
    "redis-cli XADD jobs '*' id demo-2",
    "from controller.client import",
    ".venv/bin/udp-client add 7",
    "curl -s -XPOST",
    "redis-cli XADD jobs '*' id demo-3",
    "from datetime import",
    ".venv/bin/jobctl list",
}


def test_every_readme_block_is_run_or_explained() -> None:
    starts = set(NOT_RUN) | RUN
    for language, code in readme_blocks():
        assert language in {"sh", "python", "json", "ini"}, language
        if language in {"sh", "python"}:
            assert any(code.startswith(start) for start in starts), code


def localize(code: str, udp: int, http: int, redis_port: int = 6379) -> str:
    """Point an example at the test's controller and redis-server instead of make run's."""
    code = code.replace(".venv/bin/udp-client ", f".venv/bin/udp-client --server 127.0.0.1:{udp} ")
    code = code.replace(".venv/bin/jobctl ", f".venv/bin/jobctl --url http://127.0.0.1:{http} ")
    code = code.replace("127.0.0.1:5555", f"127.0.0.1:{udp}")
    code = code.replace("127.0.0.1:8080", f"127.0.0.1:{http}")
    return code.replace("redis-cli ", f"redis-cli -p {redis_port} ")


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A directory where `.venv/bin/...` is this test run's environment."""
    work = tmp_path / "work"
    work.mkdir()
    (work / ".venv").symlink_to(sys.prefix)
    return work


def run_shell(code: str, cwd: Path) -> str:
    done = subprocess.run(
        ["bash", "-e", "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (code, done.stdout[-2000:], done.stderr[-2000:])
    return done.stdout


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[tuple[int, int]]:
    """(UDP port, HTTP port) of a dev-like controller: journal on, 2 local echo workers."""
    with live_controller(tmp_path, "--workers", "2") as ctl:
        yield ctl.udp_port, int(ctl.url.rsplit(":", 1)[1])


@pytest.mark.slow
def test_readme_udp_example(controller: tuple[int, int], workdir: Path) -> None:
    code = localize(block(".venv/bin/udp-client add 5"), *controller)
    out = run_shell(code, workdir)
    assert out.startswith("hi")  # the result's bytes, as they are
    assert "workers" in out


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_readme_http_example(controller: tuple[int, int], workdir: Path) -> None:
    out = run_shell(localize(block("curl -si -XPOST"), *controller), workdir)
    assert re.search(r"^HTTP/1\.1 201\b", out, re.M), out
    assert re.search(r'"state": ?"finished"', out), out
    assert re.search(r'"result": ?"hi"', out), out
    assert re.search(r'"pending": ?0', out), out


@pytest.mark.slow
def test_readme_python_example(controller: tuple[int, int], workdir: Path) -> None:
    code = localize(block("from controller.client import"), *controller)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "b'hi'\nb'join'\n"


@pytest.mark.slow
@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli is not installed")
def test_readme_redis_example(tmp_path: Path, workdir: Path) -> None:
    with (
        redis_server(tmp_path) as server,
        live_controller(tmp_path, "--workers", "1", redis={"url": server.url}) as ctl,
    ):
        http = int(ctl.url.rsplit(":", 1)[1])
        code = localize(block("redis-cli XADD jobs '*' id demo-2"), ctl.udp_port, http, server.port)
        out = run_shell(code, workdir).split()
    assert out[out.index("demo-2") - 1] == "id"
    assert "finished" in out
    assert out[out.index("result") + 1] == "hi"


# ---------------------------------------------------------------- the queues section's examples


@pytest.mark.slow
def test_readme_queue_examples_over_udp_http_and_python(
    controller: tuple[int, int], workdir: Path
) -> None:
    out = run_shell(localize(block(".venv/bin/udp-client add 7"), *controller), workdir)
    assert out.startswith("hi")
    if shutil.which("curl") is not None:
        out = run_shell(localize(block("curl -s -XPOST"), *controller), workdir)
        assert re.search(r'"state": ?"scheduled"', out), out
        assert re.search(r'"paused": ?true', out), out
        assert re.search(r'"state": ?"finished"', out), out
        assert re.search(r'"priority": ?0', out), out
    code = localize(block("from datetime import"), *controller)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "scheduled\nb'hi'\n"


@pytest.mark.slow
@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli is not installed")
def test_readme_queue_example_over_redis(tmp_path: Path, workdir: Path) -> None:
    with (
        redis_server(tmp_path) as server,
        live_controller(tmp_path, "--workers", "1", redis={"url": server.url}) as ctl,
    ):
        http = int(ctl.url.rsplit(":", 1)[1])
        code = localize(block("redis-cli XADD jobs '*' id demo-3"), ctl.udp_port, http, server.port)
        run_shell(code, workdir)
        shown: dict[str, object] = {}

        def finished() -> bool:
            try:
                with urllib.request.urlopen(f"{ctl.url}/job/demo-3/", timeout=5) as resp:
                    shown.update(json.loads(resp.read()))
            except OSError:  # 404 until a controller has read the entry
                return False
            return shown["state"] == "finished"

        wait_for_condition(finished, 30)
        assert (shown["priority"], shown["owner"], shown["max_retries"]) == (5, "alice", 2)
        assert shown["result"] == "hi"


@pytest.mark.slow
def test_readme_jobctl_example(controller: tuple[int, int], workdir: Path) -> None:
    udp, http = controller
    body = json.dumps({"id": "demo-1", "payload": "hi"}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{http}/job/", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 201
    out = run_shell(localize(block(".venv/bin/jobctl list"), udp, http), workdir)
    assert "default" in out  # the queue's name, paused and resumed


# ---------------------------------------------------------------- docs/flows.md's examples
# Each run in the page's order against a controller like `make run`'s.

FLOWS = Path(__file__).resolve().parent.parent / "docs" / "flows.md"
# What an example's output shows, by a line of the example (examples not named here must
# run without an error).
SHOWS = {
    '[{"id": "report-1"': r'"id":"report-1"',
    "client.submit_many(": r"\[b'first', b'second', b'third'\]",
    "state=waiting": r'(?s)"id":"tidy-1".*"state":"finished"',
    "/batch/$batch/": r'"counts":\{"finished":2\}',
    "progress_job:resize": r"finished 0\.75 resizing d\.png",
    '"id": "steps-1"': r"finished 0\.8 step 4 of 4",
    "events/ | grep": r'(?s)"demo-1","state":"requested".*"demo-1","state":"finished"',
    '"unique_key": "report:2026-11", "delay": 60': r"(?s) 201\n.*\"report:2026-11\".* 200$",
    '{"concurrency": 1, "rate": "2/s"}': r'(?s)"concurrency":1,"rate":"2/s".*"id":"lim-4".*"finished"',
}


def flows_examples() -> list[tuple[str, str]]:
    """(language, code) of every fenced block of docs/flows.md, in order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(FLOWS.read_text())]


def test_every_flows_example_is_shell_or_python() -> None:
    blocks = flows_examples()
    assert blocks and all(language in {"sh", "python", "text"} for language, _ in blocks), blocks
    for line in SHOWS:  # each expectation names an example that is there
        assert any(line in code for _, code in blocks), line


@pytest.fixture
def flows_ports(tmp_path: Path) -> Iterator[tuple[int, int, Path]]:
    """(UDP port, HTTP port, socket directory) of a controller like make run's."""
    with live_controller(tmp_path, "--workers", "2") as ctl:
        yield ctl.udp_port, int(ctl.url.rsplit(":", 1)[1]), tmp_path / "s"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_flows_examples_run_in_order(flows_ports: tuple[int, int, Path], workdir: Path) -> None:
    for language, code in flows_examples():
        if language == "text":  # what a command prints, shown, not run
            continue
        udp, http, sockets = flows_ports
        local = localize(code, udp, http).replace("--socket-dir .run ", f"--socket-dir {sockets} ")
        if language == "python":
            script = workdir / "example.py"
            script.write_text(local)
            local = f"{sys.executable} {script}"
        out = run_shell(local, workdir)
        assert "Traceback" not in out and '"error": "internal"' not in out, (code, out)
        for line, pattern in SHOWS.items():
            if line in code:
                assert re.search(pattern, out.strip()), (pattern, out)
