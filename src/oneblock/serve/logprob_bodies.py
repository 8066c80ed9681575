"""Log-probabilities in OpenAI's two shapes: a chat's ``logprobs.content`` list and a completion's legacy
``logprobs`` object (``tokens``, ``token_logprobs``, ``top_logprobs`` as dicts, ``text_offset``).

A token's string is its bytes decoded as UTF-8 (a token that ends inside a character shows U+FFFD, as vLLM's
do); a chat entry also carries the exact ``bytes``. ``text_offset`` counts characters from the start of the
prompt's text: the first generated token sits at ``len(prompt)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from oneblock.serve.jobs import Scored
from oneblock.text.tokenizer import ByteTokenizer, TextStream, Tokenizer


def token_bytes(tokenizer: Tokenizer, token: int) -> bytes:
    """The bytes one id stands for (``b""`` for an id the tokenizer does not have: a padded head's)."""
    if isinstance(tokenizer, ByteTokenizer):
        return bytes([token]) if token < 256 else b""
    if not 0 <= token < tokenizer.vocab_size:
        return b""
    spell = getattr(tokenizer, "piece_bytes", None)  # GGUFTokenizer: byte-level BPE and SentencePiece pieces
    raw = spell(token) if callable(spell) else None
    return raw if isinstance(raw, bytes) else tokenizer.decode([token]).encode("utf-8")


class Renderer:
    """Token strings and bytes of one tokenizer, cached per id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        if token not in self.cache:
            raw = token_bytes(self.tokenizer, token)
            self.cache[token] = (raw.decode("utf-8", errors="replace"), list(raw))
        return self.cache[token]


def chat_logprobs(tokens: Sequence[Scored], render: Renderer) -> dict[str, Any]:
    """OpenAI's ``choices[i].logprobs`` of a chat: ``{"content": [{token, logprob, bytes, top_logprobs}],
    "refusal": null}``."""
    content = []
    for t in tokens:
        text, raw = render(t.id)
        top = [{"token": render(i)[0], "logprob": lp, "bytes": render(i)[1]} for i, lp in t.top]
        content.append({"token": text, "logprob": t.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


class LegacyLogprobs:
    """A completion choice's legacy ``logprobs``, built as its tokens arrive (streamed or whole).

    Args:
        tokenizer: decodes the ids, for the offsets.
        render: the token strings.
        start: ``text_offset`` of the first token added (0 with ``echo``, else the prompt text's length).
    """

    def __init__(self, tokenizer: Tokenizer, render: Renderer, start: int) -> None:
        self.stream, self.render, self.offset = TextStream(tokenizer), render, start

    def add(self, tokens: Sequence[Scored], *, flush: bool = False) -> dict[str, Any]:
        """The object for ``tokens`` (the next ones of this choice); ``flush`` after the prompt's last token, so
        that the reply's offsets start after the whole prompt text."""
        body: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in tokens:
            body["tokens"].append(self.render(t.id)[0])
            body["token_logprobs"].append(t.logprob)
            if t.logprob is None:
                body["top_logprobs"].append(None)
            else:
                alternatives = {self.render(i)[0]: lp for i, lp in t.top}
                alternatives.setdefault(self.render(t.id)[0], t.logprob)  # the chosen token always appears
                body["top_logprobs"].append(alternatives)
            body["text_offset"].append(self.offset)
            self.offset += len(self.stream.push([t.id]))
        if flush:
            self.offset += len(self.stream.flush())
            self.stream = TextStream(self.stream.tokenizer)
        return body


def joined(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several legacy objects of one choice, concatenated field by field."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in out:
            out[key] += part[key]
    return out
