"""The bearer-token file (`http_token_file`): one token a line, each line whole and stripped;
blank lines and lines starting with `#` are skipped. The one reader of that format: the HTTP
door and the console hold every token of it, and jobctl and pollers send its first one, so
a line the controller holds as one token is never sent cut (`tok # note` is one token, and
not one a header can carry: a note belongs on a #-comment line of its own)."""

from __future__ import annotations

from pathlib import Path


def token_lines(text: str) -> list[tuple[int, str]]:
    """(line number, token) for each token line of a token file's text."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        token = line.strip()
        if token and not token.startswith("#"):
            found.append((number, token))
    return found


def token_problem(token: str) -> str:
    """Why `token` cannot be sent as a bearer token ("" when it can): it goes in a header."""
    if not (token.isascii() and token.isprintable()) or " " in token:
        return "a token is printable ASCII without spaces"
    return ""


def read_file(path: str | Path) -> str:
    """The file's text; ValueError naming the file and why when it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"{path}: {why}") from None


def read_token(path: str | Path) -> str:
    """The token a client sends from a token file: its first token line, whole. ValueError
    naming the file when it cannot be read, holds no token, or that line cannot go in a
    header."""
    lines = token_lines(read_file(path))
    if not lines:
        raise ValueError(f"{path}: it holds no token")
    number, token = lines[0]
    why = token_problem(token)
    if why:
        raise ValueError(
            f"{path}: line {number}: {why}, and the controller reads each line whole as one "
            "token (put a note on a #-comment line of its own)"
        )
    return token
