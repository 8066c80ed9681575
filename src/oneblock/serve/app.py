"""The Starlette application of ``oneblock serve``: OpenAI's endpoints over the batching engine.

* ``POST /v1/chat/completions`` and ``POST /v1/completions``: whole answers, or server-sent events
  (``data: {chunk}`` ... ``data: [DONE]``) with ``"stream": true``;
* ``POST /v1/embeddings``: sentence embeddings from the embedding model, when one is loaded;
* ``GET /v1/models``, ``GET /v1/models/{id}``, and ``GET /health`` (no key needed).

Nothing here computes: generation runs on the engine's thread, embeddings in the thread pool, so the event loop
stays free and ``/health`` answers while the model works. Every refusal has OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from oneblock.errors import OneBlockError
from oneblock.inference.embedding import SentenceEncoder
from oneblock.io import jsontext
from oneblock.serve.engine import Delta, Done, Engine, Event, Job, QueueFull, Stopping
from oneblock.serve.protocol import ApiError, parse_completion, parse_embeddings
from oneblock.serve.responses import Answer, embeddings_body, model_entry

log = logging.getLogger("oneblock.serve")
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
POLL_SECONDS = 0.5  # how often a non-streamed request looks whether its client is still there


@dataclass(frozen=True)
class Limits:
    """What one request may ask for.

    Attributes:
        max_body: request body bytes (413 beyond).
        default_max_tokens: new tokens when a request names no limit (always capped by the context).
        request_seconds: generation time per request; past it the answer ends with ``finish_reason: "length"``.
        max_inputs: texts per embeddings request.
    """

    max_body: int = 1 << 20
    default_max_tokens: int = 512
    request_seconds: float = 300.0
    max_inputs: int = 256


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class Guard:
    """ASGI middleware run before any route: the Host header (against DNS rebinding, when the server listens on
    loopback only) and the API key (every path under ``/v1/``)."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, hosts: frozenset[str] | None) -> None:
        self.app, self.api_key, self.hosts = app, api_key, hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self._check(scope)
            if refusal is not None:
                await error_response(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> ApiError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.hosts is not None:
            host = headers.get("host", "")
            name = host[1 : host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]
            if name.lower() not in self.hosts:
                return ApiError(400, f"Host {host!r} is not served here; use http://127.0.0.1 or http://localhost")
        if self.api_key is not None and scope["path"].startswith("/v1/"):
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return ApiError(
                    401, "missing or wrong API key; send 'Authorization: Bearer KEY'", kind="authentication_error",
                    code="invalid_api_key",
                )  # fmt: skip
        return None


async def read_json(request: HTTPRequest, limit: int) -> Any:
    """The JSON body, refused past ``limit`` bytes (413) before it is all read, or when not JSON (400)."""
    if not request.headers.get("content-type", "").lower().startswith("application/json"):
        raise ApiError(415, "send the body as JSON with 'Content-Type: application/json'")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise ApiError(413, f"the request body is {declared} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the request body is over the limit of {limit} bytes")
    try:
        return jsontext.loads(body, what="the request body")
    except OneBlockError as error:  # not UTF-8, not JSON, nested too deeply, a number too long
        raise ApiError(400, str(error)) from None


def sse(body: dict[str, Any] | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"


def create_app(
    engine: Engine,
    *,
    model_name: str,
    embedder: SentenceEncoder | None = None,
    embedding_name: str = "all-MiniLM-L6-v2",
    api_key: str | None = None,
    hosts: frozenset[str] | None = LOOPBACK_NAMES,
    limits: Limits | None = None,
) -> ASGIApp:
    """The server's ASGI application.

    Args:
        engine: runs the generations (its tokenizer renders and encodes the prompts).
        model_name: the served model's id in ``/v1/models``.
        embedder: the embedding model, or ``None`` (then ``/v1/embeddings`` answers 404).
        embedding_name: its id in ``/v1/models``.
        api_key: required as ``Authorization: Bearer KEY`` on ``/v1/`` paths; ``None`` requires nothing.
        hosts: Host header names accepted (``None``: any, for a server bound off loopback).
        limits: body size, default tokens, time per request.
    """
    limits = limits or Limits()
    tokenizer = engine.tokenizer
    created = int(time.time())
    embed_lock = threading.Lock()  # one embedding batch at a time: memory stays one forward pass

    def models() -> list[dict[str, Any]]:
        names = [model_name] + ([embedding_name] if embedder is not None else [])
        return [model_entry(name, created) for name in names]

    async def completion(request: HTTPRequest, kind: Literal["chat", "text"]) -> Response:
        try:
            body = await read_json(request, limits.max_body)
            parsed = parse_completion(
                body, kind, tokenizer, context=engine.context, default_max=limits.default_max_tokens
            )
        except ApiError as error:
            return error_response(error)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def emit(event: Event) -> None:  # on the engine's thread
            with contextlib.suppress(RuntimeError):  # the loop has closed: the server is gone
                loop.call_soon_threadsafe(events.put_nowait, event)

        eos = tokenizer.eos_id if tokenizer.eos_id is not None else engine.decoder.model.config.eos_token_id
        job = Job(
            parsed.prompt, parsed.max_new, parsed.sampling, emit, stop=parsed.stop,
            eos_ids=frozenset({eos} if eos is not None else ()), seconds=limits.request_seconds,
        )  # fmt: skip
        try:
            engine.submit(job)
        except QueueFull:
            message = f"the server is busy ({engine.max_batch} running, {engine.max_queue} waiting); retry shortly"
            return error_response(ApiError(429, message, kind="rate_limit_error", headers={"Retry-After": "1"}))
        except Stopping:
            return error_response(ApiError(503, "the server is shutting down", kind="server_error"))
        answer = Answer(parsed)
        if parsed.stream:
            return StreamingResponse(
                stream(answer, job, events), media_type="text/event-stream", headers={"Cache-Control": "no-store"}
            )
        return await whole(request, answer, job, events)

    async def whole(request: HTTPRequest, answer: Answer, job: Job, events: asyncio.Queue[Event]) -> Response:
        pieces: list[str] = []
        try:
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), POLL_SECONDS)
                except TimeoutError:
                    if await request.is_disconnected():
                        job.cancel()
                        return Response(status_code=499)  # nobody reads it
                    continue
                if isinstance(event, Delta):
                    pieces.append(event.text)
                elif isinstance(event, Done):
                    return JSONResponse(answer.whole("".join(pieces), event))
                else:
                    return error_response(ApiError(event.status, event.message, kind="server_error"))
        finally:
            job.cancel()  # a no-op once finished; frees the row if this handler was cancelled

    async def stream(answer: Answer, job: Job, events: asyncio.Queue[Event]) -> AsyncIterator[str]:
        try:
            yield sse(answer.chunk(first=True))
            while True:
                event = await events.get()
                if isinstance(event, Delta):
                    yield sse(answer.chunk(event.text))
                elif isinstance(event, Done):
                    yield sse(answer.chunk(finish=event.finish_reason))
                    if answer.request.include_usage:
                        yield sse(answer.usage_chunk(event))
                    break
                else:
                    yield sse(ApiError(event.status, event.message, kind="server_error").body())
                    break
            yield sse("[DONE]")
        finally:
            job.cancel()  # the client went away (or the answer ended): the row is freed at the next step

    async def chat_route(request: HTTPRequest) -> Response:
        return await completion(request, "chat")

    async def text_route(request: HTTPRequest) -> Response:
        return await completion(request, "text")

    async def embeddings_route(request: HTTPRequest) -> Response:
        try:
            if embedder is None:
                raise ApiError(404, "this server has no embedding model; start it with --embedding-model minilm",
                               code="model_not_found")  # fmt: skip
            name, texts, encoding = parse_embeddings(await read_json(request, limits.max_body))
            if len(texts) > limits.max_inputs:
                raise ApiError(
                    400, f"'input' holds {len(texts)} texts; the limit is {limits.max_inputs}", param="input"
                )
            body = await run_in_threadpool(lambda: _embed(embedder, embed_lock, name, texts, encoding))
        except ApiError as error:
            return error_response(error)
        except OneBlockError as error:
            return error_response(ApiError(400, str(error), param="input"))
        return JSONResponse(body)

    async def models_route(request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": models()})

    async def model_route(request: HTTPRequest) -> Response:
        wanted = request.path_params["name"]
        for entry in models():
            if entry["id"] == wanted:
                return JSONResponse(entry)
        message = f"the model {wanted!r} does not exist here; this server has {[m['id'] for m in models()]}"
        return error_response(ApiError(404, message, param="model", code="model_not_found"))

    async def health_route(request: HTTPRequest) -> Response:
        active, waiting = engine.load()
        return JSONResponse({"status": "ok", "active": active, "waiting": waiting})

    async def http_error(request: HTTPRequest, error: Exception) -> Response:
        status, detail = getattr(error, "status_code", 500), getattr(error, "detail", "error")
        return error_response(ApiError(status, f"{request.method} {request.url.path}: {detail}"))

    routes = [
        Route("/v1/chat/completions", chat_route, methods=["POST"]),
        Route("/v1/completions", text_route, methods=["POST"]),
        Route("/v1/embeddings", embeddings_route, methods=["POST"]),
        Route("/v1/models", models_route, methods=["GET"]),
        Route("/v1/models/{name:path}", model_route, methods=["GET"]),
        Route("/health", health_route, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    return Guard(app, api_key=api_key, hosts=hosts)


def _embed(embedder: SentenceEncoder, lock: threading.Lock, name: str, texts: list[str], encoding: str) -> Any:
    with lock:
        tokens = sum(len(ids) for ids in embedder.tokenize(texts))
        vectors = embedder.encode(texts)  # (N, C), L2-normalized: what ob.embed returns
    return embeddings_body(name, vectors, encoding, tokens)
