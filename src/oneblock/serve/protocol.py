"""OpenAI's API as the server speaks it: request fields checked, response bodies and stream chunks built.

Every refusal is an ``ApiError`` whose body has OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``, so the ``openai`` client raises its usual exceptions (``BadRequestError`` for 400, ...). Fields a
client sends that change nothing here (``user``, zero penalties, ``logprobs: false``) are accepted; fields that
would change the answer but are not implemented (``n > 1``, ``tools``, ``logprobs``) are refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from oneblock.errors import InputError
from oneblock.inference.chat_template import render_chat
from oneblock.inference.sampling import Sampling
from oneblock.inference.tokenizer import Tokenizer

# The conversation format llama.cpp's server falls back to when a model has no template of its own.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MAX_STOP = 4  # OpenAI's limit on stop strings
ROLES = ("system", "developer", "user", "assistant")
UNSUPPORTED = ("tools", "functions", "tool_choice", "response_format", "logit_bias", "suffix", "echo", "best_of")


class ApiError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(
        self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, headers: Mapping[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class Request:
    """A checked chat or text completion request.

    Attributes:
        kind: ``"chat"`` (``/v1/chat/completions``) or ``"text"`` (``/v1/completions``).
        model: the ``model`` field as sent (echoed in the answer).
        prompt: the prompt's ids (for a chat, the rendered conversation ending in the assistant's header).
        max_new: tokens to generate at most: the request's, capped to what the context leaves.
        sampling, stop, stream: as sent; ``include_usage`` from ``stream_options``.
    """

    kind: Literal["chat", "text"]
    model: str
    prompt: list[int]
    max_new: int
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def parse_completion(
    body: Any, kind: Literal["chat", "text"], tokenizer: Tokenizer, *, context: int, default_max: int
) -> Request:
    """Check a request body and render its prompt.

    Args:
        body: the decoded JSON.
        kind: which endpoint received it.
        tokenizer: renders and encodes the prompt.
        context: the model's context; the prompt must leave room for at least one new token.
        default_max: new tokens when the request names no limit (still capped by the context).

    Raises:
        ApiError: 400 naming the field and the fix.
    """
    if not isinstance(body, dict):
        raise bad("body", f"the request body must be a JSON object; got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "'model' is required: a model name (this server answers with its own model)")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, [], {}):
            raise bad(name, f"'{name}' is not supported by this server; leave it out")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise bad("logprobs", "'logprobs' is not supported by this server; leave it out")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise bad(name, f"'{name}' is not supported by this server; send 0 or leave it out")
    n = body.get("n")
    if n not in (None, 1) or isinstance(n, bool):
        raise bad("n", f"'n' must be 1 (one choice per request); got {n!r}; send several requests instead")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise bad("stream_options", "'stream_options' is an object, allowed only with 'stream': true")
    include_usage = bool(options and _flag(options, "include_usage"))
    prompt = _chat_prompt(body, tokenizer) if kind == "chat" else _text_prompt(body, tokenizer)
    if len(prompt) >= context:
        raise bad(
            "messages" if kind == "chat" else "prompt",
            f"the prompt is {len(prompt)} tokens; the model's context is {context}, which must also hold at least "
            "one new token; shorten it",
            code="context_length_exceeded",
        )
    requested = _max_tokens(body)
    max_new = min(default_max if requested is None else requested, context - len(prompt))
    sampling = Sampling(temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_p=_top_p(body), seed=_seed(body))
    return Request(kind, model, prompt, max_new, sampling, _stop(body), stream, include_usage)


def _flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(name, f"'{name}' must be true or false; got {value!r}")
    return value


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and low <= value <= high)
    ):
        raise bad(name, f"'{name}' must be a number in [{low:g}, {high:g}]; got {value!r}")
    return float(value)


def _top_p(body: Mapping[str, Any]) -> float | None:
    p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if p == 0:
        raise bad("top_p", "'top_p' must be in (0, 1]; got 0 (use temperature 0 for greedy decoding)")
    return None if p == 1 else p


def _seed(body: Mapping[str, Any]) -> int | None:
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**63):
        raise bad("seed", f"'seed' must be an integer in [-2**63, 2**63) or null; got {seed!r}")
    return seed


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(name, f"'{name}' must be an integer >= 1 or null; got {value!r}")
        return value
    return None


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or not 0 < len(stops) <= MAX_STOP
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise bad("stop", f"'stop' must be a non-empty string or a list of 1 to {MAX_STOP} of them; got {stop!r}")
    return tuple(stops)


def _chat_prompt(body: Mapping[str, Any], tokenizer: Tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty list of {'role', 'content'} objects")
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad(f"messages[{i}]", f"message {i} needs a 'role' among {list(ROLES)}; got {message!r:.200}")
        role = "system" if message["role"] == "developer" else message["role"]
        conversation.append({"role": role, "content": _content(message.get("content"), i)})
    try:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
            return [int(i) for i in ids]
        return tokenizer.encode(render_chat(conversation, template=CHATML))
    except InputError as error:
        raise bad("messages", str(error)) from None


def _content(content: Any, i: int) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts, joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        texts = [p.get("text") for p in content]
        if all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise bad(f"messages[{i}].content", f"message {i}'s content must be a string or a list of text parts")


def _text_prompt(body: Mapping[str, Any], tokenizer: Tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad("prompt", f"'prompt' must be one non-empty string; got {prompt!r:.200}")
    return tokenizer.encode(prompt)


def parse_embeddings(body: Any) -> tuple[str, list[str], str]:
    """``(model, texts, encoding_format)`` of an embeddings request.

    Raises:
        ApiError: 400 for a missing model, an input that is not a string or a list of strings, or an unknown
            encoding format.
    """
    if not isinstance(body, dict):
        raise bad("body", f"the request body must be a JSON object; got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "'model' is required: a model name (this server embeds with its embedding model)")
    texts = body.get("input")
    texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise bad("input", "'input' must be a string or a non-empty list of strings (token ids are not accepted)")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise bad("encoding_format", f"'encoding_format' must be 'float' or 'base64'; got {encoding!r}")
    return model, texts, encoding
