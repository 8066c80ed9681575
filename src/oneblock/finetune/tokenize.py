"""Records to token ids and a loss mask: the model's own chat template, and only the assistant's tokens trained.

A conversation is rendered once, whole, with the tokenizer's chat template (the GGUF file's, or the tokenizer's),
and tokenized once, so the ids are exactly those the model sees when it chats. The assistant spans are found by
rendering prefixes: the text before turn ``i`` with the assistant header (``add_generation_prompt=True``) and the
text through turn ``i`` must both be prefixes of the whole rendering; the span between them, less the whitespace
the template puts after the end-of-turn marker, is the answer and its end-of-turn token. A template for which the
prefixes do not hold (one that rewrites earlier turns) is refused rather than guessed at. Characters map to tokens
through the tokenizer's offsets; a token is trained when it overlaps a span.

A chat template renders at most ``MAX_CHARS`` characters, so a record whose turns hold more than ``MAX_CONTENT``
is refused by name before rendering, or, with ``truncate``, cut to its first ``MAX_CONTENT`` characters (its
later turns dropped): far more tokens than any training window, so the window sees what the whole record gives.

Shape notation: N tokens of one example.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from oneblock.errors import InputError
from oneblock.finetune.records import Record
from oneblock.text.chat_template import render_chat
from oneblock.text.template_bounds import MAX_CHARS
from oneblock.text.tokenizer import ByteTokenizer, Tokenizer

MAX_CONTENT = MAX_CHARS // 2  # of a record's turns together; the rest of what a template may write is its markup


@dataclass(frozen=True)
class Example:
    """One tokenized example.

    Attributes:
        ids: (N,) token ids.
        trained: (N,) whether each token is a prediction target (the first token never is).
        where: the record it came from (``FILE:LINE``).
    """

    ids: tuple[int, ...]
    trained: tuple[bool, ...]
    where: str

    @property
    def n_trained(self) -> int:
        return sum(self.trained[1:])


def encode_record(record: Record, tokenizer: Tokenizer, *, truncate: bool = False) -> Example:
    """Tokenize one record with its loss mask.

    A conversation, and a prompt/completion pair when the tokenizer has a chat template (as one user and one
    assistant turn), are rendered with the template; without one a pair is ``prompt + completion`` followed by
    the end-of-text token, with the completion and that token trained.

    Args:
        truncate: cut a conversation of more than ``MAX_CONTENT`` characters to that many, instead of refusing it
            (the caller then cuts the tokens to its window).

    Raises:
        InputError: a conversation for a tokenizer without a chat template, one too long to render, or a template
            that is not stable under prefixes or fails (the record named).
    """
    messages = record.messages
    if messages is None and tokenizer.chat_template:
        messages = (
            {"role": "user", "content": record.prompt or ""},
            {"role": "assistant", "content": record.completion or ""},
        )
    if messages is None:
        prompt, completion = record.prompt or "", record.completion or ""
        ids, trained = encode_spans(tokenizer, prompt + completion, [(len(prompt), len(prompt) + len(completion))])
        if tokenizer.eos_id is not None:
            ids, trained = [*ids, tokenizer.eos_id], [*trained, True]
        return Example(tuple(ids), tuple(trained), record.where)
    if not tokenizer.chat_template:
        raise InputError(
            f"{record.where}: a conversation needs a chat template, and the tokenizer {tokenizer.name!r} has none; "
            "fine-tune a chat model (a GGUF file carries its template) or give prompt/completion or .txt data"
        )
    fitted = _fit_content(messages, record.where, truncate=truncate)
    try:
        text, spans = render_with_spans(fitted, tokenizer, where=record.where)
    except InputError as error:
        message = str(error)
        raise InputError(message if message.startswith(record.where) else f"{record.where}: {message}") from None
    ids, trained = encode_spans(tokenizer, text, spans)
    return Example(tuple(ids), tuple(trained), record.where)


def _fit_content(messages: Sequence[Mapping[str, str]], where: str, *, truncate: bool) -> Sequence[Mapping[str, str]]:
    """``messages`` whose contents add up to at most ``MAX_CONTENT`` characters: as they are, cut (``truncate``),
    or refused naming the record."""
    total = sum(len(str(m.get("content", ""))) for m in messages)
    if total <= MAX_CONTENT:
        return messages
    if not truncate:
        raise InputError(
            f"{where}: the record holds {total:,} characters, more than the {MAX_CONTENT:,} a chat template may "
            "render; split it, or pass truncate=True to cut it to seq_len tokens"
        )
    kept: list[Mapping[str, str]] = []
    left = MAX_CONTENT
    for message in messages:
        if left <= 0:
            break
        content = str(message.get("content", ""))
        kept.append({**message, "content": content[:left]})
        left -= len(content)
    return kept


def render_with_spans(
    messages: Sequence[Mapping[str, str]], tokenizer: Tokenizer, *, where: str = "a record"
) -> tuple[str, list[tuple[int, int]]]:
    """The whole rendered conversation and the character spans ``[start, end)`` of its assistant answers."""

    def render(part: Sequence[Mapping[str, str]], generation_prompt: bool) -> str:
        template = tokenizer.chat_template or ""
        return render_chat(part, template=template, add_generation_prompt=generation_prompt, **_specials(tokenizer))

    text = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[: i + 1], False)
        if not (text.startswith(before) and text.startswith(through) and len(through) > len(before)):
            raise InputError(
                f"{where}: the chat template does not render assistant turn {i} as a prefix of the whole "
                "conversation (it rewrites earlier turns, or the conversation starts with the assistant), so its "
                "tokens cannot be found; drop that turn or use a model whose template appends turns"
            )
        end = len(through.rstrip())  # the newline after the end-of-turn marker separates turns; it is not trained
        spans.append((len(before), max(end, len(before) + 1)))
    return text, spans


def encode_spans(tokenizer: Tokenizer, text: str, spans: Sequence[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """Token ids of ``text`` (special tokens matched, no BOS added) and whether each overlaps one of ``spans``."""
    ids, offsets = _encode_with_offsets(tokenizer, text)
    trained = [any(start < e and end > s for s, e in spans) for start, end in offsets]
    return ids, trained


def _encode_with_offsets(tokenizer: Tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and the character span of each; one tokenization of the whole text, as the model will see it."""
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is not None and hasattr(inner, "encode"):  # a Hugging Face ``tokenizers.Tokenizer`` (GGUF, BPE)
        encoding = inner.encode(text, add_special_tokens=False)
        return list(encoding.ids), [tuple(o) for o in encoding.offsets]
    if isinstance(tokenizer, ByteTokenizer):
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for i, char in enumerate(text):
            encoded = char.encode("utf-8")
            ids += list(encoded)
            offsets += [(i, i + 1)] * len(encoded)
        return ids, offsets
    raise InputError(f"the tokenizer {tokenizer.name!r} gives no token offsets; masking needs them")


def _specials(tokenizer: Tokenizer) -> dict[str, Any]:
    specials = getattr(tokenizer, "special_tokens", None)
    return specials() if callable(specials) else {}
