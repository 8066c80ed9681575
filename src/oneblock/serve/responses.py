"""OpenAI's response bodies: a whole completion, a stream chunk, usage, the model list, embeddings."""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from oneblock.serve.engine import Done
from oneblock.serve.protocol import Request


@dataclass(frozen=True)
class Answer:
    """What every body of one request shares: its id, its creation time and the request."""

    request: Request
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, chunk: bool) -> dict[str, Any]:
        chat = self.request.kind == "chat"
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        prefix = "chatcmpl-" if chat else "cmpl-"
        return {"id": prefix + self.id, "object": obj, "created": self.created, "model": self.request.model}

    def whole(self, text: str, done: Done) -> dict[str, Any]:
        """The non-streamed answer."""
        if self.request.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(finish_reason=done.finish_reason, logprobs=None)
        return {**self._head(False), "choices": [choice], "usage": usage(done)}

    def chunk(self, text: str | None = None, *, first: bool = False, finish: str | None = None) -> dict[str, Any]:
        """One streamed event: the assistant's role first (chat), then text, then the finish reason alone."""
        if self.request.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update(finish_reason=finish, logprobs=None)
        body = {**self._head(True), "choices": [choice]}
        if self.request.include_usage:  # OpenAI sends null usage on every chunk but the last
            body["usage"] = None
        return body

    def usage_chunk(self, done: Done) -> dict[str, Any]:
        """The last event with ``stream_options.include_usage``: no choices, the usage."""
        return {**self._head(True), "choices": [], "usage": usage(done)}


def usage(done: Done) -> dict[str, int]:
    """Exact counts: the prompt's ids and the generated ids that make the text (an end-of-turn id not counted)."""
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }


def model_entry(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "oneblock"}


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
