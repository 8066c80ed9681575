"""CORS: preflights from the ``cors_origins`` allow-list are granted (204, the ``Access-Control-Allow-*``
headers), every other preflight is a 403 in OpenAI's shape (never the routes' 401 or 405), and the answers to an
allowed origin's requests carry ``Access-Control-Allow-Origin``."""

from __future__ import annotations

import httpx
import pytest
from serve_testing import KEY, Running, tiny_model

from oneblock.errors import InputError
from oneblock.serve.engine import Engine
from oneblock.text.tokenizer import ByteTokenizer
from oneblock.web.cors import CORS

PAGE = "http://localhost:3000"
ASK = {
    "Origin": PAGE,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


@pytest.fixture(scope="module")
def allowed():
    running = Running(Engine(tiny_model(), ByteTokenizer(), max_batch=2), api_key=KEY, cors_origins=[PAGE])
    yield running
    running.close()


@pytest.fixture(scope="module")
def default():
    running = Running(Engine(tiny_model(), ByteTokenizer(), max_batch=2), api_key=KEY)
    yield running
    running.close()


def test_a_listed_origins_preflight_is_granted_and_its_requests_are_readable(allowed):
    response = httpx.options(allowed.url + "/chat/completions", headers=ASK)
    assert response.status_code == 204 and response.content == b""
    assert response.headers["access-control-allow-origin"] == PAGE
    assert response.headers["access-control-allow-methods"] == "GET, POST, OPTIONS"
    assert response.headers["access-control-allow-headers"] == "authorization, content-type"
    assert response.headers["access-control-max-age"] == "600" and response.headers["vary"] == "Origin"
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    auth = {"Authorization": f"Bearer {KEY}", "Origin": PAGE}
    answer = httpx.post(allowed.url + "/completions", json=body, headers=auth, timeout=60)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == PAGE
    refused = httpx.post(allowed.url + "/completions", json=body, headers={"Origin": PAGE}, timeout=60)
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == PAGE
    other = httpx.post(allowed.url + "/completions", json=body, headers={**auth, "Origin": "http://evil.test"})
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize("origin", ["http://evil.test", "http://localhost:3001"])
def test_an_unlisted_origins_preflight_is_a_clear_403(allowed, origin):
    response = httpx.options(allowed.url + "/chat/completions", headers={**ASK, "Origin": origin})
    assert response.status_code == 403 and "access-control-allow-origin" not in response.headers
    error = response.json()["error"]
    assert f"cross-origin requests from {origin!r} are not allowed (allowed origins: {PAGE})" in error["message"]


def test_by_default_every_preflight_is_403_not_401_or_405(default):
    for path in ("/v1/chat/completions", "/v1/embeddings", "/health", "/tokenize"):
        response = httpx.options(default.base + path, headers=ASK)
        assert response.status_code == 403, (path, response.status_code)
        assert "allowed origins: none" in response.json()["error"]["message"]
    plain = httpx.options(default.base + "/health")  # not a preflight: the routes answer as before
    assert plain.status_code == 405


@pytest.mark.parametrize("origin", ["localhost:3000", "http://a.test/path", "ftp://a.test", "http://"])
def test_origins_are_checked(origin):
    with pytest.raises(InputError, match="a CORS origin must look like"):
        CORS(None, origins=[origin])  # type: ignore[arg-type]
