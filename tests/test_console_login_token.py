"""The console's login page says where its token file is (http_token_file), so an operator
knows where to find a token (packaging/install.sh writes /etc/controller/http-tokens)."""

from __future__ import annotations

import html

from controller.doors.http.console import pages
from tests.test_http import client, http_controller


async def test_login_page_names_the_configured_token_file(sockdir, tmp_path):
    tokens = tmp_path / "a <token> dir" / "http-tokens"
    tokens.parent.mkdir()
    tokens.write_text("t\n")
    async with (
        http_controller(sockdir, workers=0, http_token_file=tokens) as ctl,
        client(ctl.url) as http,
    ):
        asked = await http.get("/ui/jobs")
        assert asked.status_code == 401
        assert f"<code>{html.escape(str(tokens))}</code> on the controller's host" in asked.text


def test_login_page_without_a_path_says_token_file_alone():
    page = pages.login_page("csrf", token_file="")
    assert "tokens of its token file.</p>" in page
