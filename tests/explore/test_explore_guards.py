"""The explorer's server under hostile or unlucky clients: foreign hosts, simple requests, bad values, a crowd of
analyses, half-open connections and clients that hang up. Each answer is a status and a message, never a 500 or
a traceback."""

from __future__ import annotations

import logging
import socket
import threading
import time

import httpx
import pytest
import torch
from explore_testing import Explorable, LiveServer, tiny

from oneblock.explore.server import create_app
from oneblock.web.guards import HostPolicy

pytest.importorskip("starlette")
from starlette.testclient import TestClient


def client(explorable, **options) -> TestClient:
    return TestClient(create_app(explorable, **options), base_url="http://127.0.0.1:8000")


def test_only_this_servers_names_and_port_are_answered(decoder):
    app = create_app(decoder, hosts=HostPolicy("127.0.0.1", 8000))
    for host, status in [("127.0.0.1:8000", 200), ("localhost:8000", 200), ("[::1]:8000", 200)]:
        assert TestClient(app, base_url=f"http://{host}").get("/api/card").status_code == status
    for host in ("attacker.example:8000", "localhost:9999"):
        response = TestClient(app, base_url=f"http://{host}").get("/api/card")
        assert response.status_code == 400
        assert response.json()["error"].startswith(f"Host {host!r} is not this server's")
        assert "config" not in response.text  # nothing of the model leaks


def test_a_simple_request_cannot_post(decoder):
    response = client(decoder).post("/api/analyze", content=b'{"text": "hi"}', headers={"Content-Type": "text/plain"})
    assert response.status_code == 415
    assert "must be Content-Type: application/json; got text/plain" in response.json()["error"]


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b'{"text": "a", "temperature": 1e-310}', r"temperature must lie in \[0\.01, 10\]; got 1e-310"),
        (b'{"text": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", "nested 30001 deep; the limit is 32"),
        (b'{"ids": [' + b"7" * 5000 + b"]}", "has 5000 digits; the limit is 40"),
        (b'{"text": "\\ud800"}', r"lone surrogate U\+D800 at character offset 0"),
        (b'{"text": "a", "seed": 1e400}', r"seed must be an integer"),
    ],
)
def test_bad_values_are_400s_with_a_message(decoder, body, match):
    import re

    response = client(decoder).post("/api/analyze", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert re.search(match, response.json()["error"]), response.json()


def test_an_answer_with_a_non_finite_number_still_encodes(decoder, monkeypatch):
    monkeypatch.setattr("oneblock.explore.server.analyze", lambda *a: {"p": [1.0, float("nan")], "q": float("inf")})
    response = client(decoder).post("/api/analyze", json={"text": "a"})
    assert response.status_code == 200 and response.json() == {"p": [1.0, None], "q": None}


def test_a_crowd_of_analyses_gets_503_and_the_page_still_loads(decoder, monkeypatch):
    release, started = threading.Event(), threading.Event()

    def blocked(*args):
        started.set()
        release.wait(20)
        return {"done": True}

    monkeypatch.setattr("oneblock.explore.server.analyze", blocked)
    app = create_app(decoder)
    server = LiveServer(app)
    answers: dict[int, httpx.Response] = {}

    def post(i):
        answers[i] = httpx.post(server.url + "api/analyze", json={"text": "a"}, timeout=30)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(2)]
    try:
        threads[0].start()
        assert started.wait(10)
        threads[1].start()
        while app.state.gate.admitted < 2:
            time.sleep(0.01)
        for _ in range(3):  # beyond one running and one waiting: refused at once
            busy = httpx.post(server.url + "api/analyze", json={"text": "a"}, timeout=10)
            assert busy.status_code == 503 and int(busy.headers["retry-after"]) >= 1
            assert "busy" in busy.json()["error"]
        assert httpx.get(server.url + "static/explore.js", timeout=10).status_code == 200
        assert httpx.get(server.url + "api/card", timeout=10).status_code == 200
        release.set()
        for thread in threads:
            thread.join(30)
    finally:
        release.set()
        server.stop()
    assert [answers[i].status_code for i in range(2)] == [200, 200]


def _closed_by_server(sock: socket.socket, wait: float = 10.0) -> bool:
    sock.settimeout(wait)
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_headers_that_never_finish_are_cut_off(decoder):
    server = LiveServer(create_app(decoder), header_seconds=0.3)
    try:
        slow = socket.create_connection(("127.0.0.1", server.port))
        slow.sendall(b"GET /api/card HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never the blank line
        assert _closed_by_server(slow)
        idle = socket.create_connection(("127.0.0.1", server.port))  # connects and says nothing
        assert _closed_by_server(idle)
        assert httpx.get(server.url + "api/card", timeout=10).status_code == 200
    finally:
        server.stop()


def test_connections_beyond_the_cap_are_closed_on_arrival(decoder):
    server = LiveServer(create_app(decoder), max_connections=3, header_seconds=30)
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
    try:
        time.sleep(0.2)  # let the server accept them
        extra = socket.create_connection(("127.0.0.1", server.port))
        assert _closed_by_server(extra, wait=5)
        for sock in held:
            sock.close()
        time.sleep(0.2)
        assert httpx.get(server.url + "api/card", timeout=10).status_code == 200
    finally:
        for sock in held:
            sock.close()
        server.stop()


def test_a_client_that_hangs_up_is_not_an_error(decoder, caplog):
    server = LiveServer(create_app(decoder))
    try:
        with caplog.at_level(logging.INFO):
            sock = socket.create_connection(("127.0.0.1", server.port))
            sock.sendall(
                b"POST /api/analyze HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"text": '
            )
            time.sleep(0.3)
            sock.close()
            time.sleep(0.5)
            assert httpx.get(server.url + "api/card", timeout=10).status_code == 200
    finally:
        server.stop()
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert errors == [], [r.getMessage() for r in errors]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder-decoder"])
def test_a_half_precision_model_is_explored(arch, dtype):
    explorable = tiny(arch)
    explorable = Explorable(explorable.model.to(dtype), explorable.codec, explorable.name, explorable.source)
    test_client = client(explorable)
    card = test_client.get("/api/card").json()
    assert all(check["passed"] for check in card["checks"]), card["checks"]
    response = test_client.post("/api/analyze", json={"text": "Attention"})
    assert response.status_code == 200, response.text
    if arch != "encoder":
        step = test_client.post("/api/generate", json={"text": "Attention", "greedy": True})
        assert step.status_code == 200, step.text
        with torch.no_grad():  # the greedy token is the half-precision model's own
            ids = torch.tensor([list(b"Attention")])
            logits = explorable.model(ids) if arch == "decoder" else explorable.model(ids, ids)
        assert step.json()["appended"]["id"] == int(logits[0, -1].argmax())


def test_a_waiting_request_whose_client_left_is_not_computed(decoder, monkeypatch, caplog):
    release, calls = threading.Event(), []

    def blocked(explorable, request):
        calls.append(request.ids)
        release.wait(20)
        return {"done": True}

    monkeypatch.setattr("oneblock.explore.server.analyze", blocked)
    app = create_app(decoder)
    server = LiveServer(app)
    answer: list[httpx.Response] = []
    first = threading.Thread(
        target=lambda: answer.append(httpx.post(server.url + "api/analyze", json={"ids": [1]}, timeout=30))
    )
    try:
        with caplog.at_level(logging.INFO):
            first.start()
            while not calls:
                time.sleep(0.01)
            body = b'{"ids": [2]}'
            gone = socket.create_connection(("127.0.0.1", server.port))
            gone.sendall(
                b"POST /api/analyze HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            while app.state.gate.admitted < 2:  # it waits behind the first
                time.sleep(0.01)
            gone.close()
            time.sleep(0.3)
            release.set()
            first.join(30)
            while app.state.gate.admitted:
                time.sleep(0.01)
    finally:
        release.set()
        server.stop()
    assert answer[0].status_code == 200
    assert calls == [[1]]  # the second never ran
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
