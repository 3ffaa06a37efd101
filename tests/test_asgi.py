"""The HTTP door's router (controller/doors/http/asgi.py) driven as an ASGI app: paths with and
without their slash, /job/{id}/, HEAD, 404, 405, a failing handler, the body stream."""

from __future__ import annotations

import json
from typing import Any

import pytest

from controller import containment
from controller.doors.http.asgi import (
    ClientDisconnect,
    Request,
    Response,
    Router,
    json_response,
)


async def echo(request: Request) -> Response:
    body = b"".join([chunk async for chunk in request.stream()])
    return json_response(
        {
            "method": request.method,
            "params": request.path_params,
            "query": request.query_params,
            "type": request.header(b"content-type"),
            "body": body.decode(),
        }
    )


async def broken(request: Request) -> Response:
    raise RuntimeError("a bug")


ROUTER = Router(
    [
        ("/health/", echo, ["GET"]),
        ("/job/", echo, ["GET", "POST"]),
        ("/", echo, ["GET"]),
        ("/broken/", broken, ["GET"]),
    ],
    echo,
    ["GET", "PUT", "DELETE"],
)


async def call(
    method: str,
    path: str,
    *,
    query: bytes = b"",
    body: list[bytes] | None = None,
    disconnect: bool = False,
) -> tuple[int, dict[bytes, bytes], Any]:
    messages: list[dict[str, Any]] = [
        {"type": "http.request", "body": part, "more_body": True} for part in body or []
    ]
    messages.append({"type": "http.disconnect"} if disconnect else {"type": "http.request"})
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "query_string": query,
        "headers": [(b"content-type", b"application/json")],
    }
    await ROUTER(scope, receive, send)
    start, answer = sent
    headers = dict(start["headers"])
    assert int(headers[b"content-length"]) == len(answer["body"])
    return start["status"], headers, json.loads(answer["body"]) if answer["body"] else None


@pytest.mark.parametrize("path", ["/health/", "/health", "/job/", "/job", "/"])
async def test_each_path_with_and_without_its_slash(path):
    status, headers, answer = await call("GET", path, query=b"a=1&b=&a=2")
    assert status == 200 and headers[b"content-type"] == b"application/json"
    assert answer["query"] == {"a": "2", "b": ""} and answer["params"] == {}


@pytest.mark.parametrize("path", ["/job/A-1/", "/job/A-1"])
async def test_a_job_path_names_its_id(path):
    status, _, answer = await call("PUT", path, body=[b'{"st', b'ate": 1}'])
    assert status == 200
    assert answer["params"] == {"job_id": "A-1"} and answer["body"] == '{"state": 1}'


@pytest.mark.parametrize("path", ["/health//", "/job//", "/job/a/b/", "/nope", "/job/a//"])
async def test_other_paths_are_404(path):
    assert (await call("GET", path))[::2] == (404, {"code": 404, "message": "no such path"})


async def test_wrong_method_is_405_and_head_goes_where_get_does():
    status, headers, answer = await call("PATCH", "/job/")
    assert (status, answer["message"]) == (405, "method not allowed here")
    assert headers[b"allow"] == b"GET, HEAD, POST"  # RFC 9110: a 405 says what is
    assert (await call("POST", "/health/"))[0] == 405
    status, _, answer = await call("HEAD", "/health/")
    assert status == 200 and answer["method"] == "GET"  # the endpoint answers it as a GET
    assert (await call("HEAD", "/job/x/"))[0] == 200


async def test_a_failing_handler_is_logged_and_answered_500(monkeypatch, caplog):
    monkeypatch.setattr(containment, "FAILURES", containment.Failures())  # a first failure
    status, _, answer = await call("GET", "/broken/")
    assert status == 500 and answer["code"] == 500 and "log" in answer["message"]
    assert containment.FAILURES.total == 1
    assert "GET /broken/" in caplog.text and "RuntimeError: a bug" in caplog.text


async def test_a_client_leaving_mid_body_is_client_disconnect():
    request = None

    async def keep(r: Request) -> Response:
        nonlocal request
        request = r
        with pytest.raises(ClientDisconnect):
            async for _ in r.stream():
                pass
        return Response(status=204)

    router = Router([("/x/", keep, ["POST"])], keep, [])

    messages: list[dict[str, Any]] = [
        {"type": "http.request", "body": b"{", "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/x/", "query_string": b"", "headers": []}
    await router(scope, receive, send)
    assert request is not None
    assert sent[0]["status"] == 204 and b"content-length" not in dict(sent[0]["headers"])


async def test_lifespan_is_answered():
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await ROUTER({"type": "lifespan"}, receive, send)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
