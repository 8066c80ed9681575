"""OpenAI's API as the server speaks it: request fields checked, response bodies and stream chunks built.

Every refusal is an ``ApiError`` whose body has OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``, so the ``openai`` client raises its usual exceptions (``BadRequestError`` for 400, ...). Fields a
client sends that change nothing here (``user``, zero penalties, ``logprobs: false``, ``best_of: 1``,
``suffix: ""``, ``response_format: {"type": "text"}``, ``tool_choice: "none"`` without tools) are accepted;
fields that would change the answer but are not implemented (``n > 1``, ``tools``, ``logprobs``) are refused by
name. Every string is checked as Unicode and every number as a number before it is used, so a hostile value is a
400 naming its field, never an exception.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from oneblock.errors import InputError
from oneblock.inference.sampling import Sampling
from oneblock.text.chat_template import render_chat
from oneblock.text.checks import check_text
from oneblock.text.tokenizer import Tokenizer

# The conversation format llama.cpp's server falls back to when a model has no template of its own.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MAX_STOP = 4  # OpenAI's limit on stop strings
ROLES = ("system", "developer", "user", "assistant")
MAX_MODEL_CHARS = 256  # the name is echoed in every chunk of a stream; OpenAI's own ids are under 64
UNSUPPORTED = ("tools", "functions", "tool_choice", "response_format", "logit_bias", "suffix", "echo", "best_of")
# OpenAI's values of those fields that ask for what this server does anyway (tool_choice "none" only without tools).
NO_OPS: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "suffix": ("",), "response_format": ({"type": "text"},), "tool_choice": ("none",),
}  # fmt: skip


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
    model = _model(body, "this server answers with its own model")
    for name in UNSUPPORTED:
        if not _no_op(body.get(name), NO_OPS.get(name, ())):
            raise bad(name, f"'{name}' is not supported by this server; leave it out")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise bad("logprobs", "'logprobs' is not supported by this server; leave it out")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise bad(name, f"'{name}' is not supported by this server; send 0 or leave it out")
    n = body.get("n")
    if n not in (None, 1) or isinstance(n, bool):
        raise bad("n", f"'n' must be 1 (one choice per request); got {_shown(n)}; send several requests instead")
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
        raise bad(name, f"'{name}' must be true or false; got {_shown(value)}")
    return value


def _model(body: Mapping[str, Any], answered: str) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", f"'model' is required: a model name ({answered})")
    if len(model) > MAX_MODEL_CHARS:
        raise bad("model", f"'model' is {len(model):,} characters; the limit is {MAX_MODEL_CHARS}")
    return _text("model", model)


def _text(param: str, value: str, where: str | None = None) -> str:
    """``value`` if it is valid Unicode (a JSON ``\\ud800`` escape decodes to a lone surrogate, which no
    tokenizer can encode); the refusal names ``where`` (default: the field ``param``)."""
    try:
        return check_text(value, f"'{where or param}'")
    except InputError as error:
        raise bad(param, str(error)) from None


def _no_op(value: Any, no_ops: tuple[Any, ...]) -> bool:
    """Whether a field of ``UNSUPPORTED`` asks for nothing: absent, false, empty, or one of its no-op values."""
    if value is None or value is False or value == [] or value == {}:
        return True
    return not isinstance(value, bool) and any(type(value) is type(v) and value == v for v in no_ops)


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    # An int is compared exactly, never converted: math.isfinite(10**400) raises OverflowError.
    finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (finite and low <= value <= high):
        raise bad(name, f"'{name}' must be a number in [{low:g}, {high:g}]; got {_shown(value)}")
    return float(value)


def _shown(value: Any) -> str:
    """``repr(value)`` in at most 40 characters: a 401-digit integer or a megabyte string is not echoed whole."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _top_p(body: Mapping[str, Any]) -> float | None:
    p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if p == 0:
        raise bad("top_p", "'top_p' must be in (0, 1]; got 0 (use temperature 0 for greedy decoding)")
    return None if p == 1 else p


def _seed(body: Mapping[str, Any]) -> int | None:
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**63):
        raise bad("seed", f"'seed' must be an integer in [-2**63, 2**63) or null; got {_shown(seed)}")
    return seed


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(name, f"'{name}' must be an integer >= 1 or null; got {_shown(value)}")
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
        message = f"'stop' must be a non-empty string or a list of 1 to {MAX_STOP} of them; got {_shown(stop)}"
        raise bad("stop", message)
    return tuple(_text("stop", s) for s in stops)


def _chat_prompt(body: Mapping[str, Any], tokenizer: Tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty list of {'role', 'content'} objects")
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad(f"messages[{i}]", f"message {i} needs a 'role' among {list(ROLES)}; got {_shown(message)}")
        role = "system" if message["role"] == "developer" else message["role"]
        content = _text("messages", _content(message.get("content"), i), f"messages[{i}].content")
        conversation.append({"role": role, "content": content})
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
        raise bad("prompt", f"'prompt' must be one non-empty string; got {_shown(prompt)}")
    try:
        return tokenizer.encode(_text("prompt", prompt))
    except InputError as error:
        raise bad("prompt", str(error)) from None


def parse_embeddings(body: Any) -> tuple[str, list[str], str]:
    """``(model, texts, encoding_format)`` of an embeddings request.

    Raises:
        ApiError: 400 for a missing model, an input that is not a string or a list of strings, or an unknown
            encoding format.
    """
    if not isinstance(body, dict):
        raise bad("body", f"the request body must be a JSON object; got {type(body).__name__}")
    model = _model(body, "this server embeds with its embedding model")
    texts = body.get("input")
    texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise bad("input", "'input' must be a string or a non-empty list of strings (token ids are not accepted)")
    texts = [_text("input", t, f"input[{i}]") for i, t in enumerate(texts)]
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise bad("encoding_format", f"'encoding_format' must be 'float' or 'base64'; got {_shown(encoding)}")
    return model, texts, encoding
