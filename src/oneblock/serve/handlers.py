"""The routes of ``oneblock serve``, one named handler each, over the batching engine.

A completion's body is read on the event loop (bytes only, capped in size and time); decoding the JSON, checking
the fields, rendering the chat template and tokenizing run in a worker thread, so ``/health`` and the streams of
other requests go on while a megabyte prompt is encoded. Generation runs on the engine's thread; its events come
back through an ``asyncio.Queue``. A non-streamed request watches its connection while it waits, so a client
that hangs up frees its row at the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from oneblock.errors import InputError, OneBlockError
from oneblock.inference.embedding import SentenceEncoder
from oneblock.serve.engine import Engine
from oneblock.serve.jobs import CacheFull, Done, Event, Failed, Job, PromptScores, QueueFull, Stopping
from oneblock.serve.protocol import ApiError, Request, check_window, parse_completion, parse_embeddings
from oneblock.serve.responses import Answer, embeddings_body, model_entry
from oneblock.serve.tokens import parse_detokenize, parse_tokenize, tokenizer_info
from oneblock.text.tokenizer import stop_ids_of
from oneblock.web.body import BODY_SECONDS, BadField, BodyTooLarge, BodyTooSlow, parse_json, read_body
from oneblock.web.gate import Busy, Gate, Gone

log = logging.getLogger("oneblock.serve")
CLOSE = {"Connection": "close"}  # a body left unread: the connection cannot carry another request


@dataclass(frozen=True)
class Limits:
    """What one request may ask for.

    Attributes:
        max_body: request body bytes (413 beyond).
        body_seconds: time for the whole body to arrive once the headers have (408 beyond).
        default_max_tokens: new tokens when a request names no limit (always capped by the context).
        request_seconds: generation time per request; past it the answer ends with ``finish_reason: "length"``.
        max_inputs: texts per embeddings request.
    """

    max_body: int = 1 << 20
    body_seconds: float = BODY_SECONDS
    default_max_tokens: int = 512
    request_seconds: float = 300.0
    max_inputs: int = 256


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def body_refusal(error: InputError) -> ApiError:
    """A body that could not be read or decoded: 413 too large, 408 too slow, else 400 (naming the field)."""
    if isinstance(error, BodyTooLarge):
        return ApiError(413, str(error), headers=CLOSE)
    if isinstance(error, BodyTooSlow):
        return ApiError(408, str(error), kind="timeout", headers=CLOSE)
    return ApiError(400, str(error), param=error.field if isinstance(error, BadField) else None)


def sse(body: dict[str, Any] | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"


class Events:
    """A request's events, put by the engine's thread and read on the event loop, each with its choice's index;
    ``None`` means the client left."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Event] | None] = asyncio.Queue()

    def emitter(self, index: int) -> Callable[[Event], None]:
        """What choice ``index``'s job calls, on the engine's thread."""

        def emit(event: Event) -> None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: the server is gone
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))

        return emit

    async def get(self) -> tuple[int, Event] | None:
        return await self.queue.get()


class Service:
    """The server's state (engine, models, limits) and its routes, each a method.

    Args:
        engine: runs the generations (its tokenizer renders and encodes the prompts).
        model_name: the served model's id in ``/v1/models``.
        embedder: the embedding model, or ``None`` (then ``/v1/embeddings`` answers 404).
        embedding_name: its id in ``/v1/models``.
        limits: body size and time, default tokens, time per request.

    When the engine serves LoRA adapters, a completion's ``model`` names the base (``model_name``) or one of them
    (vLLM's convention), and any other name is a 404 ``model_not_found``; without adapters any name is answered by
    the one model, as llama-server does.
    """

    def __init__(
        self, engine: Engine, *, model_name: str, embedder: SentenceEncoder | None, embedding_name: str,
        limits: Limits,
    ) -> None:  # fmt: skip
        self.engine, self.embedder, self.limits = engine, embedder, limits
        adapters = engine.adapters.names if engine.adapters is not None else ()
        self.generators = {model_name: 0} | {name: k for k, name in enumerate(adapters, start=1)}
        self.names = [*self.generators] + ([embedding_name] if embedder is not None else [])
        self.base_name = model_name
        every = [model_name, *adapters] + ([embedding_name] if embedder is not None else [])
        if len(set(every)) != len(every):
            raise InputError(
                f"the served names must differ: the model, its adapters and the embedding model are {every}"
            )
        self.created = int(time.time())
        # One embedding batch at a time, waiting on the event loop: memory stays one forward pass, and no worker
        # thread is spent waiting (the prompts of completions are tokenized in those threads).
        self.embed_gate = Gate(queue=engine.max_queue)
        tokenizer = engine.tokenizer
        self.eos_ids = frozenset(stop_ids_of(tokenizer, engine.decoder.model.config.eos_token_id))

    # -- completions -----------------------------------------------------------------------------------------------

    async def chat(self, request: HTTPRequest) -> Response:
        return await self.completion(request, "chat")

    async def text(self, request: HTTPRequest) -> Response:
        return await self.completion(request, "text")

    async def completion(self, request: HTTPRequest, kind: Literal["chat", "text"]) -> Response:
        try:
            raw = await read_body(request, self.limits.max_body, seconds=self.limits.body_seconds)
            parsed = await run_in_threadpool(lambda: self.check_completion(parse_json(raw), kind))
            adapter = self.adapter(parsed.model)
        except ApiError as error:
            return error_response(error)
        except InputError as error:
            return error_response(body_refusal(error))
        except ClientDisconnect:
            return Response(status_code=499)  # nobody reads it
        events = Events()
        jobs = self.jobs(parsed, events, adapter)
        refusal = self.submit(jobs)
        if refusal is not None:
            return error_response(refusal)
        answer = Answer(parsed, self.engine.tokenizer)
        if parsed.stream:
            headers = {"Cache-Control": "no-store"}
            return StreamingResponse(stream(answer, jobs, events), media_type="text/event-stream", headers=headers)
        return await whole(request, answer, jobs, events)

    def jobs(self, parsed: Request, events: Events, adapter: int) -> list[Job]:
        """One job per choice, choice ``i`` emitting to ``events`` with its index; the ``n`` choices of a prompt
        share its scores (``echo`` with ``logprobs``)."""
        scores = [PromptScores() for _ in parsed.prompts]
        return [
            Job(
                parsed.prompts[i // parsed.n].ids, parsed.max_new[i // parsed.n], parsed.sampling, events.emitter(i),
                stop=parsed.stop, eos_ids=self.eos_ids, seconds=self.limits.request_seconds, row=i % parsed.n,
                top=parsed.logprobs, echo=parsed.echo, scores=scores[i // parsed.n], constraint=parsed.constraint,
                adapter=adapter,
                cache_prompt=parsed.cache_prompt,
            )
            for i in range(parsed.choices)
        ]  # fmt: skip

    def check_completion(self, body: Any, kind: Literal["chat", "text"]) -> Request:
        """In a worker thread: the fields, the rendered and tokenized prompt."""
        engine = self.engine
        parsed = parse_completion(
            body, kind, engine.tokenizer, context=engine.context, default_max=self.limits.default_max_tokens,
            vocab=engine.vocab,
        )  # fmt: skip
        if parsed.choices > engine.max_queue:
            param = "n" if parsed.n > 1 else "prompt"
            raise ApiError(
                400, f"the request asks for {parsed.choices} choices ({len(parsed.prompts)} prompts x n = {parsed.n}); "
                f"this server queues at most {engine.max_queue} (--max-queue)", param=param,
            )  # fmt: skip
        return parsed

    def adapter(self, model: str) -> int:
        """The adapter a completion's ``model`` names (0: the base; any name when no adapter is served).

        Raises:
            ApiError: 404 ``model_not_found``, a name the server does not generate with.
        """
        if len(self.generators) == 1:
            return 0
        if model not in self.generators:
            raise ApiError(
                404, f"the model {model[:300]!r} does not exist here; this server generates with {[*self.generators]}",
                param="model", code="model_not_found",
            )  # fmt: skip
        return self.generators[model]

    def submit(self, jobs: list[Job]) -> ApiError | None:
        engine = self.engine
        try:
            engine.submit_all(jobs)
        except QueueFull:
            message = f"the server is busy ({engine.max_batch} running, {engine.max_queue} waiting); retry shortly"
            return ApiError(429, message, kind="rate_limit_error", headers={"Retry-After": "1"})
        except CacheFull as full:
            message = (
                f"the key/value cache is reserved by the requests in flight: this one needs {full.needed} positions "
                f"and {full.free} of {full.budget} are free; retry shortly, or ask for fewer max_tokens"
            )
            return ApiError(503, message, kind="server_error", code="cache_full", headers={"Retry-After": "1"})
        except Stopping:
            return ApiError(503, "the server is shutting down", kind="server_error")
        except InputError as error:  # the prompt and max_tokens were fitted to the context before: a last guard
            return ApiError(400, str(error), code="context_length_exceeded")
        return None

    # -- embeddings and the rest ---------------------------------------------------------------------------------------

    async def embeddings(self, request: HTTPRequest) -> Response:
        embedder = self.embedder
        try:
            if embedder is None:
                raise ApiError(404, "this server has no embedding model; start it with --embedding-model minilm",
                               code="model_not_found")  # fmt: skip
            raw = await read_body(request, self.limits.max_body, seconds=self.limits.body_seconds)
            name, inputs, encoding = await run_in_threadpool(
                lambda: parse_embeddings(parse_json(raw), embedder.dim, embedder.vocab_size)
            )
            if len(inputs) > self.limits.max_inputs:
                raise ApiError(
                    400, f"'input' holds {len(inputs)} inputs; the limit is {self.limits.max_inputs}", param="input"
                )
            body = await self.embed_gate.run(lambda: _embed(embedder, name, inputs, encoding))
        except ApiError as error:
            return error_response(error)
        except (BodyTooLarge, BodyTooSlow, BadField) as error:
            return error_response(body_refusal(error))
        except OneBlockError as error:
            return error_response(ApiError(400, str(error), param="input"))
        except Busy as busy:
            message = "the embedding model is busy with other requests; retry shortly"
            headers = {"Retry-After": str(busy.retry_after)}
            return error_response(ApiError(503, message, kind="server_error", headers=headers))
        except (ClientDisconnect, Gone):
            return Response(status_code=499)
        return JSONResponse(body)

    async def tokenize(self, request: HTTPRequest) -> Response:
        """``POST /tokenize``: llama.cpp's ``{"content": text}`` or vLLM's ``{"prompt": text}`` to the ids."""
        engine = self.engine
        return await self._tokens(request, lambda body: parse_tokenize(body, engine.tokenizer, engine.context))

    async def detokenize(self, request: HTTPRequest) -> Response:
        """``POST /detokenize``: ``{"tokens": [ids]}`` to ``{"content": text, "prompt": text}``."""
        engine = self.engine
        return await self._tokens(request, lambda body: parse_detokenize(body, engine.tokenizer, engine.vocab))

    async def tokenizer_info(self, request: HTTPRequest) -> Response:
        """vLLM's ``GET /tokenizer_info``: the special tokens, the chat template, the context."""
        return JSONResponse(tokenizer_info(self.engine.tokenizer, self.engine.context))

    async def _tokens(self, request: HTTPRequest, work: Callable[[Any], dict[str, Any]]) -> Response:
        try:
            raw = await read_body(request, self.limits.max_body, seconds=self.limits.body_seconds)
            return JSONResponse(await run_in_threadpool(lambda: work(parse_json(raw))))
        except ApiError as error:
            return error_response(error)
        except InputError as error:
            return error_response(body_refusal(error))
        except ClientDisconnect:
            return Response(status_code=499)

    def models(self) -> list[dict[str, Any]]:
        return [
            model_entry(name, self.created, parent=self.base_name if self.generators.get(name, 0) else None)
            for name in self.names
        ]

    async def model_list(self, request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": self.models()})

    async def model(self, request: HTTPRequest) -> Response:
        wanted = request.path_params["name"]
        for entry in self.models():
            if entry["id"] == wanted:
                return JSONResponse(entry)
        message = f"the model {wanted[:300]!r} does not exist here; this server has {self.names}"
        return error_response(ApiError(404, message, param="model", code="model_not_found"))

    async def health(self, request: HTTPRequest) -> Response:
        active, waiting = self.engine.load()
        return JSONResponse({"status": "ok", "active": active, "waiting": waiting})

    async def http_error(self, request: HTTPRequest, error: Exception) -> Response:
        status, detail = getattr(error, "status_code", 500), getattr(error, "detail", "error")
        return error_response(ApiError(status, f"{request.method} {request.url.path}: {detail}"))

    async def internal_error(self, request: HTTPRequest, error: Exception) -> Response:
        """Any exception no handler expected: logged, and answered in OpenAI's shape (never plain text)."""
        log.error("serve: %s %s failed", request.method, request.url.path, exc_info=error)
        message = f"internal error ({type(error).__name__}); the server's log has details"
        return error_response(ApiError(500, message, kind="server_error"))


async def whole(request: HTTPRequest, answer: Answer, jobs: list[Job], events: Events) -> Response:
    """The non-streamed answer, once the engine has finished every choice; a 499 as soon as the client hangs up."""
    watcher = asyncio.create_task(_watch_hang_up(request, jobs, events))
    try:
        while True:
            item = await events.get()
            if item is None:
                return Response(status_code=499)  # nobody reads it
            index, event = item
            if isinstance(event, Failed):
                return error_response(failure(event))
            if isinstance(event, Done):
                answer.finish(index, event)
                if answer.finished:
                    return JSONResponse(answer.whole())
            else:
                answer.add(index, event)
    finally:
        watcher.cancel()
        for job in jobs:
            job.cancel()  # a no-op once finished; frees the rows if this handler was cancelled or one choice failed


async def _watch_hang_up(request: HTTPRequest, jobs: list[Job], events: Events) -> None:
    """Wait for the client's disconnect (the body has been read: the next message is one) and drop the jobs."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for job in jobs:
        job.cancel()  # the engine frees the rows at its next step
    events.queue.put_nowait(None)


async def stream(answer: Answer, jobs: list[Job], events: Events) -> AsyncIterator[str]:
    """Server-sent events: the role, the text, each choice's finish, the usage, or an error event; ``[DONE]``."""
    try:
        for chunk in answer.first_chunks():
            yield sse(chunk)
        while True:
            item = await events.get()
            if item is None:
                break
            index, event = item
            if isinstance(event, Failed):
                yield sse(failure(event).body())
                break
            if isinstance(event, Done):
                for chunk in answer.finish(index, event):
                    yield sse(chunk)
                if answer.finished:
                    if answer.request.include_usage:
                        yield sse(answer.usage_chunk())
                    break
            elif (piece := answer.add(index, event)) is not None:
                yield sse(piece)
        yield sse("[DONE]")
    finally:
        for job in jobs:
            job.cancel()  # the client went away (or the answer ended): the rows are freed at the next step


def failure(event: Failed) -> ApiError:
    code = {503: "server_shutting_down", 507: "insufficient_memory"}.get(event.status)
    return ApiError(event.status, event.message, kind="server_error", code=code)


def _embed(embedder: SentenceEncoder, name: str, inputs: list[str] | list[list[int]], encoding: str) -> Any:
    """Under the embedding gate (the tokenizer's truncation setting is shared): refuse an input longer than the
    model's window, then embed texts, or token ids as given."""
    texts = [t for t in inputs if isinstance(t, str)]
    ids = [row for row in inputs if isinstance(row, list)]
    lengths = embedder.lengths(texts) if texts else [len(row) for row in ids]
    check_window(inputs, lengths, embedder.max_length)
    # (N, C), L2-normalized: what ob.embed returns
    vectors = embedder.encode(texts) if texts else embedder.encode_ids(ids)
    tokens = sum(lengths)
    return embeddings_body(name, vectors, encoding, tokens)
