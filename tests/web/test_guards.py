"""Host and content-type checks: only this server's own names and port are answered, and only JSON is POSTed."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from oneblock.web.guards import HostCheck, HostPolicy, JSONOnly, is_json_type, split_host


def app(policy: HostPolicy) -> Starlette:
    async def echo(request):
        return JSONResponse({"ok": True})

    routes = [Route("/", echo, methods=["GET", "POST"])]
    return Starlette(routes=routes, middleware=[Middleware(HostCheck, policy=policy), Middleware(JSONOnly)])


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("127.0.0.1:8000", ("127.0.0.1", 8000)),
        ("[::1]:8000", ("::1", 8000)),
        ("LocalHost", ("localhost", None)),
        ("localhost:http", ("localhost", -1)),
        ("[::1]junk", ("::1", -1)),
    ],
)
def test_split_host(value, expected):
    assert split_host(value) == expected


@pytest.mark.parametrize(
    ("policy", "host", "allowed"),
    [
        (HostPolicy("127.0.0.1", 8000), "127.0.0.1:8000", True),
        (HostPolicy("127.0.0.1", 8000), "localhost:8000", True),
        (HostPolicy("127.0.0.1", 8000), "[::1]:8000", True),
        (HostPolicy("127.0.0.1", 8000), "localhost:8001", False),  # another local service's port
        (HostPolicy("127.0.0.1", 8000), "localhost", False),
        (HostPolicy("127.0.0.1", 8000), "attacker.example:8000", False),  # DNS rebinding
        (HostPolicy("127.0.0.1", 8000), "", False),
        (HostPolicy("127.0.0.1", 80), "localhost", True),  # port 80 may be left out
        (HostPolicy("box.lan", 8000), "box.lan:8000", True),  # the host the user named
        (HostPolicy("0.0.0.0", 8000), "192.168.1.20:8000", True),  # all interfaces: any IP literal
        (HostPolicy("0.0.0.0", 8000), "attacker.example:8000", False),
        (HostPolicy("127.0.0.1", None), "127.0.0.1:51234", True),
    ],
)
def test_host_policy(policy, host, allowed):
    assert policy.allows(host) is allowed


def test_a_foreign_host_is_refused_before_the_app():
    client = TestClient(app(HostPolicy("127.0.0.1", 8000)), base_url="http://attacker.example:8000")
    response = client.get("/")
    assert response.status_code == 400
    assert response.json()["error"].startswith("Host 'attacker.example:8000' is not this server's; use ")
    ok = TestClient(app(HostPolicy("127.0.0.1", 8000)), base_url="http://localhost:8000").get("/")
    assert ok.status_code == 200 and ok.json() == {"ok": True}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("application/json", True),
        ("Application/JSON; charset=utf-8", True),
        ("application/merge-patch+json", True),
        ("text/plain", False),
        ("application/x-www-form-urlencoded", False),
        ("multipart/form-data; boundary=x", False),
        ("", False),
    ],
)
def test_json_types(value, expected):
    assert is_json_type(value) is expected


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_post_that_is_not_json_gets_415(kind):
    client = TestClient(app(HostPolicy()), base_url="http://127.0.0.1:8000")
    headers = {"Content-Type": kind} if kind else {}
    response = client.post("/", content=b'{"text": "hi"}', headers=headers)
    assert response.status_code == 415
    assert "POST bodies must be Content-Type: application/json; got " + (kind or "none") == response.json()["error"]
    assert client.post("/", json={"text": "hi"}).status_code == 200
    assert client.get("/").status_code == 200  # GET carries no body: no content type needed
