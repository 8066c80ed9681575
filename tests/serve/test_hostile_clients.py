"""Clients that stall, hang up or send huge prompts cannot lock others out or keep rows; a stop ends streams
cleanly.

Raw sockets play the stalled clients (headers never finished, a body that never arrives, a hang-up mid-answer);
``/health`` is called while big prompts are tokenized; a SIGTERM (``handle_exit``, what the signal calls) arrives
while a stream cannot finish within the grace period.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
from serve_testing import KEY, Running, slow_engine, sse_events

from oneblock.serve.app import Limits
from oneblock.text.tokenizer import ByteTokenizer

HEADERS = {"Authorization": f"Bearer {KEY}"}


def client(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url, api_key=KEY, max_retries=0, timeout=60)


def connect(running) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", running.port), timeout=30)
    sock.settimeout(30)
    return sock


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a timeout fails the test). A connection the
    server closed with our bytes unread is reset rather than closed: the same end."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def head(running, method: str, path: str, length: int) -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{running.port}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def until(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the condition was not reached"
        time.sleep(0.01)


@pytest.fixture
def small(monkeypatch):
    """One row, one waiting, eight connections, half a second for headers and bodies."""
    engine = slow_engine(monkeypatch, 0.001, max_batch=1, max_queue=1)
    running = Running(
        engine, api_key=KEY, header_seconds=0.5, max_connections=8, limits=Limits(body_seconds=0.5)
    )  # fmt: skip
    yield running
    running.close()


def test_connections_that_never_finish_their_headers_are_closed_and_others_get_in(small):
    stalled = [connect(small) for _ in range(12)]  # more than the connections the server holds
    for sock in stalled:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # no blank line: never complete
    for sock in stalled:
        assert read_to_close(sock) == b""  # closed by the server, without an answer
        sock.close()
    answer = client(small).completions.create(model="m", prompt="abc", max_tokens=3)
    assert answer.usage.completion_tokens == 3


def test_a_body_that_never_arrives_is_408_and_its_connection_closed(small):
    body = json.dumps({"model": "m", "prompt": "abc", "max_tokens": 3}).encode()
    stalled = [connect(small) for _ in range(4)]
    for sock in stalled:
        sock.sendall(head(small, "POST", "/v1/completions", len(body)) + body[:10])  # and nothing more
    for sock in stalled:
        status, _, rest = read_to_close(sock).partition(b"\r\n")
        assert status == b"HTTP/1.1 408 Request Timeout"
        error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
        assert error["message"] == "the request body took more than 0.5 s to arrive"
        sock.close()
    assert client(small).completions.create(model="m", prompt="abc", max_tokens=3).usage.completion_tokens == 3


def test_a_client_that_hangs_up_on_a_whole_answer_frees_its_row(monkeypatch):
    running = Running(slow_engine(monkeypatch, 0.02, max_batch=2), api_key=KEY)
    try:
        body = json.dumps({"model": "m", "prompt": "abc", "max_tokens": 480}).encode()
        sock = connect(running)
        sock.sendall(head(running, "POST", "/v1/completions", len(body)) + body)
        until(lambda: running.engine.load()[0] == 1)
        start = running.engine.steps
        until(lambda: running.engine.steps >= start + 3)  # decoding, tokens flowing
        sock.close()
        until(lambda: running.engine.load() == (0, 0))
        assert running.engine.steps - start < 400  # freed long before its 480 tokens
        assert running.engine.reserved == 0
        assert client(running).completions.create(model="m", prompt="a", max_tokens=2).usage.completion_tokens == 2
    finally:
        running.close()


class HeldTokenizer(ByteTokenizer):
    """Bytes, but a long text waits for ``released`` before it is encoded: tokenizing takes as long as the test
    wants."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.released = threading.Event(), threading.Event()

    def encode(self, text: str) -> list[int]:
        if len(text) > 100_000:
            self.entered.set()
            self.released.wait(60)
        return super().encode(text)


def test_health_answers_while_big_chat_requests_are_tokenized(monkeypatch):
    tokenizer = HeldTokenizer()
    running = Running(slow_engine(monkeypatch, tokenizer=tokenizer), api_key=KEY)
    statuses: list[int] = []
    try:
        big = {"model": "m", "messages": [{"role": "user", "content": "word " * 180_000}]}  # 0.9 MB

        def send() -> None:
            response = httpx.post(running.url + "/chat/completions", json=big, headers=HEADERS, timeout=120)
            statuses.append(response.status_code)

        senders = [threading.Thread(target=send) for _ in range(3)]
        for t in senders:
            t.start()
        assert tokenizer.entered.wait(60)
        health = httpx.get(running.base + "/health", timeout=30)  # the loop is free while they are tokenized
        assert health.json()["status"] == "ok"
        assert any(t.is_alive() for t in senders) and not statuses  # still in progress
    finally:
        tokenizer.released.set()
        for t in senders:
            t.join(120)
        running.close()
    assert statuses == [400, 400, 400]  # then refused: 900,000 tokens do not fit the context


def test_after_sigterm_a_stream_past_the_grace_period_ends_with_an_error_event_and_done(monkeypatch):
    running = Running(slow_engine(monkeypatch, 0.02), api_key=KEY, grace=0.5)
    try:
        body = {"model": "m", "prompt": "abc", "max_tokens": 480, "stream": True}
        with httpx.stream("POST", running.url + "/completions", json=body, headers=HEADERS, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")  # the stream has begun
            running.server.handle_exit(signal.SIGTERM, None)
            events = sse_events(lines)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "the server is shutting down" in error["message"] and error["type"] == "server_error"
        texts = [json.loads(e)["choices"][0] for e in events[:-2]]
        assert texts and all(t["finish_reason"] is None for t in texts)  # it did not get to finish
        running.thread.join(30)
        assert not running.thread.is_alive()  # and the server stopped
    finally:
        running.close()
