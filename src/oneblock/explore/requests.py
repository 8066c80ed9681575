"""What a page may ask for, checked before any tensor is made: the text or ids, the sampling settings, the caps.

Every problem raises ``InputError`` with the field, the value received and what is allowed; the server turns it
into a 400 with that message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from oneblock.errors import InputError
from oneblock.explore.loading import Explorable
from oneblock.text.checks import check_text

FIELDS = ("text", "ids", "target", "target_ids", "temperature", "top_k", "seed", "greedy")
MAX_TEMPERATURE = 10.0
# Below this, logits / temperature can overflow to inf (1e-310 is a legal JSON number) and softmax gives NaN;
# the page's slider stops at 0.1, and 0.01 is already indistinguishable from greedy.
MIN_TEMPERATURE = 0.01
MAX_TOP_K = 50


@dataclass(frozen=True)
class Limits:
    """Caps on one request: characters of text, tokens per sequence, bytes of the JSON body."""

    max_chars: int = 4000
    max_tokens: int = 128
    max_body: int = 65536

    def as_dict(self) -> dict[str, int]:
        return {"max_chars": self.max_chars, "max_tokens": self.max_tokens, "max_body": self.max_body}


@dataclass(frozen=True)
class Request:
    """A checked request.

    Attributes:
        ids: the (first) stack's token ids: the decoder's for a decoder, the source for an encoder-decoder.
        target: the decoder's ids of an encoder-decoder (``None`` otherwise).
        temperature, top_k: the next-token view, softmax(logits / temperature), its ``top_k`` bars.
        seed, greedy: how a generation step picks its token.
    """

    ids: list[int]
    target: list[int] | None
    temperature: float = 1.0
    top_k: int = 10
    seed: int = 0
    greedy: bool = True


def token_cap(explorable: Explorable, limits: Limits) -> int:
    """The longest sequence accepted: the limit, or the model's context if shorter."""
    return min(limits.max_tokens, explorable.config.max_seq_len)


def parse_request(body: Any, explorable: Explorable, limits: Limits) -> Request:
    """Check a decoded JSON body and turn its text into ids.

    Raises:
        InputError: not an object, an unknown field, a text that is empty or too long, ids that are not
            integers of the vocabulary, too many tokens, a temperature, ``top_k`` or seed out of range.
    """
    if not isinstance(body, dict):
        raise InputError(f"the request must be a JSON object; got {type(body).__name__}")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise InputError(f"unknown field(s) {unknown}; known fields are {list(FIELDS)}")
    cfg = explorable.config
    ids = _sequence(body, "text", "ids", explorable, limits, required=True) or []  # required: never None
    target = None
    if cfg.arch == "encoder-decoder":
        target = _sequence(body, "target", "target_ids", explorable, limits, required=False)
        if target is None:
            target = list(ids)  # the decoder reads the source back, as in BART's denoising pre-training
    elif "target" in body or "target_ids" in body:
        raise InputError(f"target and target_ids apply to encoder-decoder models; this model is an {cfg.arch}")
    return Request(
        ids=ids,
        target=target,
        temperature=_temperature(body.get("temperature", 1.0)),
        top_k=_integer(body.get("top_k", 10), "top_k", 1, MAX_TOP_K),
        seed=_integer(body.get("seed", 0), "seed", 0, 2**63 - 1),
        greedy=_boolean(body.get("greedy", True), "greedy"),
    )


def _sequence(
    body: dict[str, Any], text_key: str, ids_key: str, explorable: Explorable, limits: Limits, *, required: bool
) -> list[int] | None:
    if text_key in body and ids_key in body:
        raise InputError(f"give {text_key} or {ids_key}, not both")
    cap = token_cap(explorable, limits)
    if text_key in body:
        text = body[text_key]
        if not isinstance(text, str):
            raise InputError(f"{text_key} must be a string; got {type(text).__name__}")
        check_text(text, text_key)
        if not text.strip():
            raise InputError(f"{text_key} is empty; type some text")
        if len(text) > limits.max_chars:
            raise InputError(f"{text_key} has {len(text)} characters; the limit is {limits.max_chars}")
        ids = explorable.codec.encode(text)
        if not ids:
            raise InputError(f"{text_key} {text[:40]!r} gives no tokens")
        if len(ids) > cap:
            raise InputError(f"{text_key} is {len(ids)} tokens long; the limit is {cap} tokens, shorten the text")
    elif ids_key in body:
        ids = body[ids_key]
        if not isinstance(ids, list) or not ids:
            raise InputError(f"{ids_key} must be a non-empty list of token ids; got {_short(ids)}")
        if len(ids) > cap:
            raise InputError(f"{ids_key} has {len(ids)} tokens; the limit is {cap}")
        if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise InputError(f"{ids_key} must hold integers only; got {_short(ids)}")
    elif required:
        raise InputError(f"give {text_key} (a string) or {ids_key} (a list of token ids)")
    else:
        return None
    vocab = explorable.config.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise InputError(
            f"token ids {bad[:5]} lie outside the model's vocabulary [0, {vocab}); "
            f"the tokenizer ({explorable.codec.name}) does not fit this model"
        )
    return list(ids)


def _temperature(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"temperature must be a number; got {_short(value)}")
    if not MIN_TEMPERATURE <= value <= MAX_TEMPERATURE:
        raise InputError(
            f"temperature must lie in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]; got {value} "
            "(greedy takes the most likely token)"
        )
    return float(value)


def _integer(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InputError(f"{name} must be an integer in [{low}, {high}]; got {_short(value)}")
    return value


def _boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{name} must be true or false; got {_short(value)}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
