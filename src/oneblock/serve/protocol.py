"""OpenAI's API as the server speaks it: a completion request checked into a ``Request``, and an embeddings
request (``/tokenize`` and ``/detokenize`` are ``tokens``'s).

Every field is honoured, accepted because its value asks for nothing, or refused by name (``fields``); every
refusal is an ``ApiError`` in OpenAI's shape (``checks``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from oneblock.errors import InputError
from oneblock.inference.constraints import Constraint
from oneblock.inference.sampling import Sampling
from oneblock.serve.checks import ApiError, bad, flag, integer, shown, text
from oneblock.serve.fields import check_known, sampling, top_logprobs
from oneblock.serve.prompts import CHATML, Prompt, chat_prompt, text_prompts
from oneblock.serve.tool_template import GENERIC, template_grammar, tool_format
from oneblock.serve.tools import Tools, parse_tools
from oneblock.text.tokenizer import Tokenizer, stop_ids_of

__all__ = ["CHATML", "ApiError", "Prompt", "Request", "bad", "parse_completion", "parse_embeddings"]
MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_N = 16  # choices per prompt
MAX_MODEL_CHARS = 256  # the name is echoed in every chunk of a stream; OpenAI's own ids are under 64
EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})


@dataclass(frozen=True)
class Request:
    """A checked chat or text completion request.

    Attributes:
        kind: ``"chat"`` (``/v1/chat/completions``) or ``"text"`` (``/v1/completions``).
        model: the ``model`` field as sent (echoed in the answer).
        prompts: the prompts (a chat has one: the rendered conversation ending in the assistant's header).
        n: choices per prompt; choice ``j`` of a prompt draws with ``seed + j``.
        max_new: tokens to generate at most per prompt: the request's, capped to what the context leaves (0 only
            for ``echo`` with ``max_tokens: 0``, which scores the prompt alone).
        sampling, stop, stream: as sent; ``include_usage`` from ``stream_options``.
        logprobs: alternatives to report per token (``None``: no log-probabilities).
        echo: the prompt's text (and, with ``logprobs``, its log-probabilities) starts each choice.
        constraint: the grammar of ``response_format`` (``json_object``, ``json_schema``) or of ``grammar`` (Lark),
            or ``None``.
        tools: the tools an answer may call (``tool_choice`` other than ``none``): each answer is a call or a
            reply, read by ``tools.read_answer`` (``tool_template.read_template_answer`` in a template's own format).
        cache_prompt: llama.cpp's field: read the prompts' leading blocks from the prefix cache and keep theirs
            (default); ``False`` computes them whole and keeps nothing.
    """

    kind: Literal["chat", "text"]
    model: str
    prompts: list[Prompt]
    n: int
    max_new: list[int]
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None = None
    echo: bool = False
    constraint: Constraint | None = None
    tools: Tools | None = None
    cache_prompt: bool = True

    @property
    def prompt(self) -> list[int]:
        """The first prompt's ids."""
        return self.prompts[0].ids

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n


def parse_completion(
    body: Any, kind: Literal["chat", "text"], tokenizer: Tokenizer, *, context: int, default_max: int,
    vocab: int | None = None,
) -> Request:  # fmt: skip
    """Check a request body and render its prompts.

    Args:
        body: the decoded JSON.
        kind: which endpoint received it.
        tokenizer: renders and encodes the prompt.
        context: the model's context; a prompt must leave room for at least one new token.
        default_max: new tokens when the request names no limit (still capped by the context).
        vocab: the ids the engine samples from (default: the tokenizer's).

    Raises:
        ApiError: 400 naming the field and the fix.
    """
    if not isinstance(body, dict):
        raise bad("body", f"the request body must be a JSON object; got {type(body).__name__}")
    vocab = tokenizer.vocab_size if vocab is None else vocab
    model = _model(body, "this server answers with its own model")
    check_known(body, kind)
    n = integer(body, "n", 1, MAX_N, " (choices per prompt)") or 1
    _check_no_ops(body, n)
    settings = sampling(body, vocab)
    stream = flag(body, "stream")
    include_usage = _stream_options(body, stream)
    logprobs = top_logprobs(body, kind)
    echo = flag(body, "echo")
    tools = parse_tools(body) if kind == "chat" else None
    if tools is not None:
        tools = replace(tools, format=tool_format(getattr(tokenizer, "chat_template", None)))
    if tools is not None and tools.active and logprobs is not None:
        raise bad("logprobs", "'logprobs' with tools is not implemented (a tool call is read whole); leave it out")
    prompts = [chat_prompt(body, tokenizer, tools)] if kind == "chat" else text_prompts(body, tokenizer, vocab)
    requested = _max_tokens(body, echo)
    max_new = []
    for prompt in prompts:
        room = context - len(prompt.ids)
        if room < (0 if requested == 0 else 1):
            raise bad(
                "messages" if kind == "chat" else "prompt",
                f"the prompt is {len(prompt.ids)} tokens; the model's context is {context}, which must also hold "
                "at least one new token; shorten it",
                code="context_length_exceeded",
            )
        max_new.append(min(default_max if requested is None else requested, room))
    stop = _stop(body)
    constraint = _response_format(body.get("response_format"), tokenizer)
    if body.get("grammar") is not None:
        if constraint is not None:
            raise bad("grammar", "'grammar' and a JSON 'response_format' each constrain the answer; send one of them")
        constraint = _grammar(body["grammar"], tokenizer)
    if tools is not None and tools.active:
        if constraint is not None:
            raise bad("response_format", "a JSON 'response_format' cannot be combined with tools; send one of them")
        constraint = _tool_grammar(tools, tokenizer)
    cache_prompt = flag(body, "cache_prompt") if body.get("cache_prompt") is not None else True
    return Request(
        kind, model, prompts, n, max_new, settings, stop, stream, include_usage, logprobs, echo, constraint,
        tools if tools is not None and tools.active else None, cache_prompt,
    )  # fmt: skip


def _response_format(value: Any, tokenizer: Tokenizer) -> Constraint | None:
    """OpenAI's ``response_format`` compiled by llguidance (``oneblock.inference.constraints``): ``text`` (or
    absent) is no constraint, ``json_object`` any JSON object, ``json_schema`` its ``json_schema.schema``."""
    if value is None or value == {}:
        return None
    if isinstance(value, dict):
        extra = set(value) - {"type", "json_schema"}
        if extra:
            name = sorted(extra)[0]
            raise bad("response_format", f"'response_format.{name}' is not supported by this server; leave it out")
        spec = value.get("json_schema")
        if value.get("type") != "json_schema" and spec is not None:
            raise bad("response_format", "'response_format.json_schema' goes with 'type': 'json_schema'")
        if isinstance(spec, dict):
            for name in spec:
                if name not in ("name", "description", "schema", "strict"):
                    raise bad("response_format", f"'response_format.json_schema.{name}' is not supported; leave it out")
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise bad(
            "response_format", f"'response_format' must be an object whose 'type' is 'text', 'json_object' or "
            f"'json_schema'; got {shown(value)}",
        )  # fmt: skip
    stops = list(stop_ids_of(tokenizer))  # a constrained answer may end at any of them
    if not stops and kind != "text":
        name = getattr(tokenizer, "name", type(tokenizer).__name__)
        raise bad(
            "response_format", f"'response_format' cannot be served: a constrained answer ends with the model's "
            f"end-of-text token, and this model's tokenizer ({name!r}) has none",
        )  # fmt: skip
    try:
        return Constraint.from_response_format(tokenizer, value, eos_ids=stops or None)
    except InputError as error:
        raise bad("response_format", f"'response_format' cannot be served: {error}") from None


def _tool_grammar(tools: Tools, tokenizer: Tokenizer) -> Constraint:
    """The answer's grammar with tools: a JSON call of the allowed tools, or a reply (``tools.Tools.schema``); in
    a template's own format, text or calls as that format writes them (``tool_template.template_grammar``)."""
    stops = list(stop_ids_of(tokenizer))
    if not stops:
        name = getattr(tokenizer, "name", type(tokenizer).__name__)
        raise bad("tools", f"'tools' cannot be served: a call ends with the model's end-of-text token, and this "
                  f"model's tokenizer ({name!r}) has none")  # fmt: skip
    try:
        if tools.format != GENERIC:
            return Constraint.lark(tokenizer, template_grammar(tools, tokenizer), eos_ids=stops)
        return Constraint.json_schema(tokenizer, tools.schema(), eos_ids=stops)
    except InputError as error:
        raise bad("tools", f"'tools' cannot be served (a function's parameters): {error}") from None


def _grammar(value: Any, tokenizer: Tokenizer) -> Constraint:
    """The ``grammar`` extension: a Lark grammar in llguidance's dialect (``start`` is the start rule; terminals
    may be ``/regex/``), compiled against the vocabulary; the answer ends with the end-of-text token."""
    if not isinstance(value, str) or not value.strip():
        raise bad(
            "grammar", f"'grammar' must be a Lark grammar (a non-empty string with a 'start' rule); got {shown(value)}"
        )
    stops = list(stop_ids_of(tokenizer))
    if not stops:
        name = getattr(tokenizer, "name", type(tokenizer).__name__)
        raise bad(
            "grammar", f"'grammar' cannot be served: a constrained answer ends with the model's end-of-text token, "
            f"and this model's tokenizer ({name!r}) has none",
        )  # fmt: skip
    try:
        return Constraint.lark(tokenizer, text("grammar", value), eos_ids=stops)
    except InputError as error:
        raise bad("grammar", f"'grammar' cannot be served: {error}") from None


def _model(body: Mapping[str, Any], answered: str) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", f"'model' is required: a model name ({answered})")
    if len(model) > MAX_MODEL_CHARS:
        raise bad("model", f"'model' is {len(model):,} characters; the limit is {MAX_MODEL_CHARS}")
    return text("model", model)


def _check_no_ops(body: Mapping[str, Any], n: int) -> None:
    """Fields read but not implemented: accepted only with a value that asks for nothing."""
    best_of = body.get("best_of")
    if best_of is not None and (isinstance(best_of, bool) or best_of != n):
        raise bad("best_of", f"'best_of' is not supported by this server (only best_of = n = {n}); leave it out")
    if body.get("suffix") not in (None, ""):
        raise bad("suffix", "'suffix' is not supported by this server (insertion is not implemented); leave it out")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", f"'user' must be a string; got {shown(user)}")


def _stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream or not isinstance(options, dict):
        raise bad("stream_options", "'stream_options' is an object, allowed only with 'stream': true")
    for key in options:
        if key != "include_usage":
            raise bad(f"stream_options.{key}", f"'stream_options.{key}' is not supported by this server; leave it out")
    return flag(options, "include_usage", "stream_options.include_usage")


def _max_tokens(body: Mapping[str, Any], echo: bool) -> int | None:
    values = {name: body[name] for name in ("max_completion_tokens", "max_tokens") if body.get(name) is not None}
    for name, value in values.items():
        least = 0 if echo else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            extra = " (0 only with 'echo': true)" if not echo else ""
            raise bad(name, f"'{name}' must be an integer >= {least}{extra} or null; got {shown(value)}")
    if len(set(values.values())) > 1:
        raise bad("max_tokens", f"'max_tokens' and 'max_completion_tokens' differ ({values}); send one of them")
    return next(iter(values.values()), None)


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
        message = f"'stop' must be a non-empty string or a list of 1 to {MAX_STOP} of them; got {shown(stop)}"
        raise bad("stop", message)
    return tuple(text("stop", s) for s in stops)


def parse_embeddings(
    body: Any, dim: int | None = None, vocab: int | None = None
) -> tuple[str, list[str] | list[list[int]], str]:
    """``(model, inputs, encoding_format)`` of an embeddings request; the inputs are texts, or token ids of the
    embedding model's tokenizer read as its input as given (special tokens included: ``[CLS] ... [SEP]``).

    Args:
        body: the decoded JSON.
        dim: the embedding model's width C; ``dimensions`` is accepted only equal to it.
        vocab: the embedding model's vocabulary; token ids must lie in ``[0, vocab)``.

    Raises:
        ApiError: 400 for a missing model, an input that is not a string, a list of non-empty strings, a list of
            token ids or a list of such lists, an id outside the vocabulary, an unknown encoding format, a
            ``dimensions`` other than the model's width, or any other field.
    """
    if not isinstance(body, dict):
        raise bad("body", f"the request body must be a JSON object; got {type(body).__name__}")
    model = _model(body, "this server embeds with its embedding model")
    for name in body:
        if name not in EMBEDDING_FIELDS:
            raise bad(name, f"'{name}' is not supported by this server's /v1/embeddings; leave it out")
    inputs = _embedding_inputs(body.get("input"), vocab)
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise bad("encoding_format", f"'encoding_format' must be 'float' or 'base64'; got {shown(encoding)}")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", f"'user' must be a string; got {shown(user)}")
    dimensions = body.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or dimensions != dim):
        raise bad(
            "dimensions", f"'dimensions' must equal the embedding model's width ({dim}) or be left out; got "
            f"{shown(dimensions)}: the model was not trained for shortened vectors (Matryoshka), so cutting them "
            "would lose accuracy silently",
        )  # fmt: skip
    return model, inputs, encoding


def _embedding_inputs(value: Any, vocab: int | None) -> list[str] | list[list[int]]:
    """OpenAI's four forms of ``input``: a string, a list of strings, a list of token ids (one input), a list of
    such lists; each non-empty, ids in ``[0, vocab)``."""
    if isinstance(value, list) and value and all(_is_ids(i) for i in value):
        rows: list[list[int]] = value
        where = [f"input[{i}]" for i in range(len(rows))]
    elif isinstance(value, list) and value and _is_ids(value):
        rows, where = [value], ["input"]
    else:
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise bad(
                "input", f"'input' must be a string, a non-empty list of strings, a list of token ids or a list "
                f"of such lists; got {shown(value)}",
            )  # fmt: skip
        texts = [text("input", t, f"input[{i}]") for i, t in enumerate(texts)]
        empty = [i for i, t in enumerate(texts) if not t]
        if empty:
            name = "input" if isinstance(value, str) else f"input[{empty[0]}]"
            raise bad("input", f"'{name}' is an empty string; every input needs text to embed")
        return texts
    for name, row in zip(where, rows, strict=True):
        if not row:
            raise bad("input", f"'{name}' is an empty list; every input needs a token to embed")
        outside = [t for t in row if vocab is not None and not 0 <= t < vocab]
        if outside:
            raise bad(
                "input", f"'{name}' holds token id {shown(outside[0])}, outside the embedding model's vocabulary "
                f"[0, {vocab}) ({vocab} ids)",
            )  # fmt: skip
    return rows


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def check_window(texts: Sequence[str | list[int]], lengths: list[int], window: int) -> None:
    """Refuse a text longer than the embedding model's window, which would otherwise be cut silently.

    Raises:
        ApiError: 400 naming the first such input, its length and the window.
    """
    for i, length in enumerate(lengths):
        if length > window:
            where = "input" if len(texts) == 1 else f"input[{i}]"
            raise bad(
                "input", f"'{where}' is {length} tokens; the embedding model reads at most {window} (special tokens "
                "included); shorten it or split it", code="context_length_exceeded",
            )  # fmt: skip
