"""OpenAI's response bodies: a whole completion, stream chunks, usage, the model list, embeddings.

One ``Answer`` follows every choice of a request (``n`` per prompt, choice ``index`` = prompt * n + j) as its
events arrive, for a stream (``chunk``) or for the whole answer (``whole``).
"""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from oneblock.serve.jobs import Delta, Done, Echoed, Scored
from oneblock.serve.logprob_bodies import LegacyLogprobs, Renderer, chat_logprobs, joined
from oneblock.serve.protocol import Prompt, Request
from oneblock.serve.tool_template import GENERIC, read_template_answer
from oneblock.serve.tools import read_answer
from oneblock.text.tokenizer import Tokenizer


@dataclass
class Choice:
    """What one choice has produced so far."""

    index: int
    prompt: Prompt
    pieces: list[str] = field(default_factory=list)
    tokens: list[Scored] = field(default_factory=list)  # a chat's scored tokens
    legacy: LegacyLogprobs | None = None
    parts: list[dict[str, Any]] = field(default_factory=list)  # a completion's legacy logprobs, piece by piece
    done: Done | None = None
    message: dict[str, Any] | None = None  # with tools: the answer read whole (its content or its tool_calls)
    finish_reason: str = ""


class Answer:
    """The bodies of one request: its id, its creation time, and each choice's state.

    Args:
        request: the checked request.
        tokenizer: renders the tokens of log-probabilities.
    """

    def __init__(self, request: Request, tokenizer: Tokenizer) -> None:
        self.request = request
        self.id = uuid.uuid4().hex
        self.created = int(time.time())
        self.render = Renderer(tokenizer)
        self.choices = [Choice(i, request.prompts[i // request.n]) for i in range(request.choices)]
        if request.kind == "text" and request.logprobs is not None:
            for choice in self.choices:
                start = 0 if request.echo else len(choice.prompt.text)
                choice.legacy = LegacyLogprobs(tokenizer, self.render, start)

    @property
    def chat(self) -> bool:
        return self.request.kind == "chat"

    def _head(self, chunk: bool) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {"id": prefix + self.id, "object": obj, "created": self.created, "model": self.request.model}

    def add(self, index: int, event: Delta | Echoed) -> dict[str, Any] | None:
        """Record a choice's event; return its stream chunk (``None`` with tools: the answer is read whole)."""
        choice = self.choices[index]
        if self.request.tools is not None and isinstance(event, Delta):
            choice.pieces.append(event.text)
            return None
        if isinstance(event, Echoed):
            text, flush = choice.prompt.text, True
        else:
            text, flush = event.text, False
        choice.pieces.append(text)
        logprobs: Any = None
        if self.request.logprobs is not None:
            if self.chat:
                choice.tokens += event.tokens
                logprobs = chat_logprobs(event.tokens, self.render)
            elif choice.legacy is not None:
                logprobs = choice.legacy.add(event.tokens, flush=flush)
                choice.parts.append(logprobs)
        if self.chat:
            return self._chunk(
                {"index": index, "delta": {"content": text}, "finish_reason": None, "logprobs": logprobs}
            )
        return self._chunk({"index": index, "text": text, "finish_reason": None, "logprobs": logprobs})

    def finish(self, index: int, done: Done) -> list[dict[str, Any]]:
        """Record a choice's end; return its last chunks (with tools, the reply or the calls; the finish reason)."""
        choice = self.choices[index]
        choice.done, choice.finish_reason = done, done.finish_reason
        if not self.chat:
            return [self._chunk({"index": index, "text": "", "finish_reason": done.finish_reason, "logprobs": None})]
        chunks = []
        if self.request.tools is not None:
            tools, text = self.request.tools, "".join(choice.pieces)
            content, calls = read_answer(text, tools) if tools.format == GENERIC else read_template_answer(text, tools)
            choice.message = {"role": "assistant", "content": content}
            if calls is not None:
                choice.message["tool_calls"] = calls
                choice.finish_reason = "tool_calls" if done.finish_reason == "stop" else done.finish_reason
                delta: dict[str, Any] = {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}
            else:
                delta = {"content": content}
            chunks.append(self._chunk({"index": index, "delta": delta, "finish_reason": None, "logprobs": None}))
        end = {"index": index, "delta": {}, "finish_reason": choice.finish_reason, "logprobs": None}
        return [*chunks, self._chunk(end)]

    @property
    def finished(self) -> bool:
        return all(choice.done is not None for choice in self.choices)

    def first_chunks(self) -> list[dict[str, Any]]:
        """A chat stream's opening chunks: the assistant's role, one per choice (none for completions)."""
        if not self.chat:
            return []
        return [
            self._chunk({"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                         "logprobs": None})
            for c in self.choices
        ]  # fmt: skip

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        body = {**self._head(True), "choices": [choice]}
        if self.request.include_usage:  # OpenAI sends null usage on every chunk but the last
            body["usage"] = None
        return body

    def whole(self) -> dict[str, Any]:
        """The non-streamed answer, once every choice is done."""
        choices = []
        for c in self.choices:
            assert c.done is not None
            text = "".join(c.pieces)
            logprobs: Any = None
            if self.request.logprobs is not None:
                logprobs = chat_logprobs(c.tokens, self.render) if self.chat else joined(c.parts)
            body: dict[str, Any] = {"index": c.index}
            message = c.message or {"role": "assistant", "content": text}
            body.update({"message": message} if self.chat else {"text": text})
            body.update(finish_reason=c.finish_reason, logprobs=logprobs)
            choices.append(body)
        return {**self._head(False), "choices": choices, "usage": self.usage()}

    def usage_chunk(self) -> dict[str, Any]:
        """The last event with ``stream_options.include_usage``: no choices, the usage."""
        return {**self._head(True), "choices": [], "usage": self.usage()}

    def usage(self) -> dict[str, Any]:
        """Exact counts: each prompt's ids once (not once per choice), and every choice's generated ids that make
        its text (an end-of-turn id not counted); ``prompt_tokens_details.cached_tokens``, OpenAI's field, the
        prompt positions read from the prefix cache (a prompt's first choice's, as its ids are counted once)."""
        prompt = sum(len(p.ids) for p in self.request.prompts)
        completion = sum(c.done.completion_tokens for c in self.choices if c.done is not None)
        firsts = self.choices[:: self.request.n]  # choice 0 of each prompt
        cached = sum(c.done.cached_tokens for c in firsts if c.done is not None)
        return {
            "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }  # fmt: skip


def model_entry(name: str, created: int, *, parent: str | None = None) -> dict[str, Any]:
    """One model of ``/v1/models``; an adapter names its base in ``parent``, as vLLM's entries do."""
    entry: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": "oneblock"}
    if parent is not None:
        entry["parent"] = parent
    return entry


def embeddings_body(model: str, vectors: Tensor, encoding: str, tokens: int) -> dict[str, Any]:
    """(N, C) float32 vectors as OpenAI's list; ``base64`` is the little-endian float32 bytes of each vector."""
    data = []
    for i, row in enumerate(vectors.to(torch.float32)):
        if encoding == "base64":
            value: Any = base64.b64encode(row.contiguous().numpy().astype("<f4").tobytes()).decode("ascii")
        else:
            value = row.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
