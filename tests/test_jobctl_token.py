"""jobctl's token: read from a token file as the controller reads its http_token_file (each
line whole), and from the packaged /etc/controller/http-tokens by default when the URL is on
this host and the file can be read. Against a real controller."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.client import jobctl
from controller.doors.http.access import read_tokens
from controller.tokens import read_token
from tests.helpers import live_controller
from worker import poller


def test_the_token_sent_is_one_the_controller_holds(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("\n  # operators\n\n  s3cret-1  \nother\n")
    assert read_token(tokens) == "s3cret-1"
    assert read_token(tokens) in read_tokens(tokens)
    # The controller holds "tok # note" as one token: jobctl says so instead of sending "tok".
    tokens.write_text("tok # note\n")
    assert read_tokens(tokens) == {"tok # note"}
    with pytest.raises(ValueError, match=r"line 1: .*reads each line whole.*#-comment"):
        read_token(tokens)
    tokens.write_text("# only a comment\n\n")
    with pytest.raises(ValueError, match="holds no token"):
        read_token(tokens)
    with pytest.raises(ValueError, match="No such file"):
        read_token(tmp_path / "missing")


def test_a_poller_reads_its_token_file_as_the_controller_does(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# hub\n  p0ller-token  \n")
    assert poller.read_token(str(tokens)) == "p0ller-token"
    assert poller.read_token(str(tokens)) in read_tokens(tokens)
    tokens.write_text("tok # note\n")  # one token to the controller: never sent cut
    with pytest.raises(Exception, match="reads each line whole"):
        poller.read_token(str(tokens))


def test_a_note_after_the_token_is_refused_before_any_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret # the operators' token\n")
    code = jobctl.main(["--url", "http://127.0.0.1:9", "--token-file", str(tokens), "queues"])
    assert code == 2
    assert "line 1" in capsys.readouterr().err


def test_only_this_hosts_urls_get_the_default_token() -> None:
    for url in ("http://127.0.0.1:8080", "http://localhost:8080/", "https://[::1]:8443/api/"):
        assert jobctl.on_this_host(url), url
    for url in ("http://10.0.0.1:8080", "https://ctl.example:8443", "http://[fe80::1]:80", "x"):
        assert not jobctl.on_this_host(url), url


def test_the_packaged_token_file_is_read_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = tmp_path / "http-tokens"
    tokens.write_text("# written by install.sh\nfirst-token\nsecond\n")
    tokens.chmod(0o600)
    elsewhere = tmp_path / "elsewhere"
    monkeypatch.setattr(jobctl, "DEFAULT_TOKEN_FILE", elsewhere)
    with live_controller(tmp_path, "--workers", "0", http_token_file=str(tokens)) as ctl:
        # No file at the default path: no token, refused.
        assert jobctl.main(["--url", ctl.url, "queues"]) == 1
        assert "401" in capsys.readouterr().err
        monkeypatch.setattr(jobctl, "DEFAULT_TOKEN_FILE", tokens)
        assert jobctl.main(["--url", ctl.url, "list", "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == {}
        # --token-file wins over the default.
        wrong = tmp_path / "wrong"
        wrong.write_text("guess\n")
        assert jobctl.main(["--url", ctl.url, "--token-file", str(wrong), "queues"]) == 1
        capsys.readouterr()
        # A default file without a usable token is a usage error that names it.
        tokens.write_text("# emptied\n")
        assert jobctl.main(["--url", ctl.url, "queues"]) == 2
        err = capsys.readouterr().err
        assert str(tokens) in err and "holds no token" in err and "--token-file" in err
