"""The Starlette application of ``oneblock serve``: OpenAI's endpoints over the batching engine.

* ``POST /v1/chat/completions`` and ``POST /v1/completions``: whole answers, or server-sent events
  (``data: {chunk}`` ... ``data: [DONE]``) with ``"stream": true``;
* ``POST /v1/responses``: OpenAI's Responses API, answered as the chat completion of the same conversation
  (``responses_api``);
* ``POST /v1/embeddings``: sentence embeddings from the embedding model, when one is loaded;
* ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``: llama.cpp's and vLLM's shapes (``tokens``);
* ``GET /v1/models``, ``GET /v1/models/{id}``, and ``GET /health`` (no key needed);
* ``GET /metrics``: Prometheus' text format (``oneblock.serve.metrics``), behind the key when one is set.

Before any route, the guards of ``oneblock.web`` (the ``Host`` header, against DNS rebinding, on a loopback
server; CORS preflights, answered for the ``cors_origins`` and refused for the rest; JSON bodies only) and the
API key answer in OpenAI's error shape. The routes are ``handlers.Service``'s
methods. Nothing here computes on the event loop, so ``/health`` answers while the model works.
"""

from __future__ import annotations

import functools
import hmac
import json
from collections.abc import Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from oneblock.inference.embedding import SentenceEncoder
from oneblock.serve.engine import Engine
from oneblock.serve.handlers import Limits, Service
from oneblock.serve.metrics import CountResponses, Metrics
from oneblock.serve.protocol import ApiError
from oneblock.serve.responses_api import create_response
from oneblock.web.cors import CORS
from oneblock.web.guards import HostCheck, HostPolicy, JSONOnly, refuse

__all__ = ["LOOPBACK", "KeyCheck", "Limits", "create_app", "openai_error"]
LOOPBACK = HostPolicy()  # loopback names with any port: what a server bound to 127.0.0.1 answers


def openai_error(status: int, message: str) -> bytes:
    """A guard's refusal in OpenAI's shape, so the ``openai`` client raises its usual exception."""
    kind, code = ("authentication_error", "invalid_api_key") if status == 401 else ("invalid_request_error", None)
    return json.dumps(ApiError(status, message, kind=kind, code=code).body()).encode()


class KeyCheck:
    """Refuse (401) a request under ``/v1/`` (or to ``/tokenize``, ``/detokenize``, ``/tokenizer_info``,
    ``/metrics``) without ``Authorization: Bearer KEY`` when a key is set."""

    def __init__(self, app: ASGIApp, *, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.api_key is not None and _keyed(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                message = "missing or wrong API key; send 'Authorization: Bearer KEY'"
                await refuse(send, 401, message, shape=openai_error)
                return
        await self.app(scope, receive, send)


def _keyed(path: str) -> bool:
    """Whether a path needs the key: the API under ``/v1/``, llama.cpp's ``/tokenize`` and ``/detokenize``, and
    ``/metrics`` (as llama-server keys it; vLLM leaves it open: the traffic it shows is the operator's)."""
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize", "/tokenizer_info", "/metrics")


def create_app(
    engine: Engine,
    *,
    model_name: str,
    embedder: SentenceEncoder | None = None,
    embedding_name: str = "all-MiniLM-L6-v2",
    api_key: str | None = None,
    hosts: HostPolicy | None = LOOPBACK,
    limits: Limits | None = None,
    cors_origins: Sequence[str] = (),
) -> Starlette:
    """The server's ASGI application.

    Args:
        engine: runs the generations (its tokenizer renders and encodes the prompts).
        model_name: the served model's id in ``/v1/models``.
        embedder: the embedding model, or ``None`` (then ``/v1/embeddings`` answers 404).
        embedding_name: its id in ``/v1/models``.
        api_key: required as ``Authorization: Bearer KEY`` on ``/v1/`` paths and ``/metrics``; ``None`` requires
            nothing.
        hosts: the ``Host`` headers answered (``None``: any, for a server bound off loopback); ``serve`` passes
            the bound port.
        limits: body size and time, default tokens, time per request.
        cors_origins: origins whose pages may call the server (``scheme://host[:port]``, or ``*`` for any); a
            CORS preflight from any other is refused with 403. None by default.
    """
    service = Service(
        engine, model_name=model_name, embedder=embedder, embedding_name=embedding_name, limits=limits or Limits()
    )
    routes = [
        Route("/v1/chat/completions", service.chat, methods=["POST"]),
        Route("/v1/completions", service.text, methods=["POST"]),
        Route("/v1/responses", functools.partial(create_response, service), methods=["POST"]),
        Route("/v1/embeddings", service.embeddings, methods=["POST"]),
        Route("/v1/models", service.model_list, methods=["GET"]),
        Route("/v1/models/{name:path}", service.model, methods=["GET"]),
        Route("/tokenize", service.tokenize, methods=["POST"]),
        Route("/detokenize", service.detokenize, methods=["POST"]),
        Route("/tokenizer_info", service.tokenizer_info, methods=["GET"]),
        Route("/health", service.health, methods=["GET"]),
    ]
    metrics = Metrics(engine)
    routes.append(Route("/metrics", metrics.route, methods=["GET"]))
    guards = [
        Middleware(CORS, origins=cors_origins, shape=openai_error),  # preflights carry no key: answered first
        Middleware(KeyCheck, api_key=api_key),
        Middleware(JSONOnly, shape=openai_error),
    ]
    if hosts is not None:
        guards.insert(0, Middleware(HostCheck, policy=hosts, shape=openai_error))  # the host first
    counted = [route.path for route in routes if route.path != "/v1/models/{name:path}"] + ["/v1/models/{id}"]
    guards.insert(0, Middleware(CountResponses, metrics=metrics, endpoints=counted))  # every answer, refusals too
    handlers = {HTTPException: service.http_error, Exception: service.internal_error}
    app = Starlette(routes=routes, middleware=guards, exception_handlers=handlers)
    app.state.hosts = hosts
    app.state.metrics = metrics
    return app
