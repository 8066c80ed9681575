"""Text <-> token ids for generation: a GPT-2 byte-level BPE ``tokenizer.json`` when one is found, else bytes.

``Tokenizer`` is the one interface every tokenizer of oneblock has (``encode``, ``decode``, ``vocab_size``,
``eos_id``, ``stop_ids``, ``name``, ``chat_template`` and ``apply_chat_template``); two of them live here, the
third (a GGUF file's) in ``oneblock.io.gguf.tokenizer``:

* ``BPETokenizer`` wraps a Hugging Face ``tokenizers`` file: ``tokenizer.json``, or the older GPT-2 pair
  ``vocab.json`` + ``merges.txt``. The ``tokenizers`` library is imported only when such a file is read.
* ``ByteTokenizer`` is the fallback: ids 0..255 are the UTF-8 bytes of the text, so any model with
  ``vocab_size >= 256`` (the byte-level models ``oneblock train`` makes) can be prompted without a vocabulary file.

Byte-level tokens can end in the middle of a multi-byte character; ``TextStream`` turns a stream of ids into text
that is printed only once complete, as generation streams tokens one at a time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from oneblock.errors import CheckpointError, InputError
from oneblock.text.checks import check_text

TOKENIZER_FILE = "tokenizer.json"
VOCAB_FILES = ("vocab.json", "merges.txt")


class Tokenizer(Protocol):
    """What generation, the chat and the CLI need from a tokenizer; ``ByteTokenizer``, ``BPETokenizer`` and
    ``oneblock.io.gguf.tokenizer.GGUFTokenizer`` all satisfy it.

    ``stop_ids`` are every id that ends a reply: ``eos_id`` first, then the ids a chat model ends its turn with
    (Llama 3's ``<|eot_id|>`` beside its ``<|end_of_text|>``); read them through :func:`stop_ids_of`, which also
    covers a tokenizer that knows only ``eos_id``.

    ``chat_template`` is ``None`` for a tokenizer that carries none; ``apply_chat_template`` then raises
    ``InputError``. Its ``tools`` (OpenAI's and Hugging Face's ``[{"type": "function", "function": {...}}]``) go to
    the template as its ``tools`` variable, as ``transformers``' ``apply_chat_template(..., tools=...)`` does.
    """

    name: str
    eos_id: int | None
    chat_template: str | None

    @property
    def stop_ids(self) -> tuple[int, ...]: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str | list[int]: ...


def stop_ids_of(tokenizer: Any, default: int | None = None) -> tuple[int, ...]:
    """The ids that end a reply of a model with this tokenizer: its ``eos_id`` (else ``default``, the model
    config's ``eos_token_id``) first, then its other end-of-turn ids, each once; empty when it has none."""
    eos = getattr(tokenizer, "eos_id", None)
    first = eos if eos is not None else default
    ids = [first] if first is not None else []
    return tuple(dict.fromkeys([*ids, *getattr(tokenizer, "stop_ids", ())]))


class EndOfTurn:
    """``stop_ids`` for a tokenizer with an ``eos_id``: it, then ``end_of_turn_ids`` (set by whoever loads the
    tokenizer from a file that lists them)."""

    eos_id: int | None
    end_of_turn_ids: tuple[int, ...] = ()

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """``eos_id`` then the end-of-turn ids, each once."""
        head = (self.eos_id,) if self.eos_id is not None else ()
        return tuple(dict.fromkeys([*head, *self.end_of_turn_ids]))


class _NoChatTemplate(EndOfTurn):
    """``apply_chat_template`` for tokenizers without a template: a clear error instead of a missing method."""

    chat_template: str | None = None
    name: str

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str | list[int]:
        raise InputError(
            f"the tokenizer {self.name!r} has no chat template, so it cannot render a conversation; use a chat "
            "model's GGUF file, or continue plain text with generate"
        )


class ByteTokenizer(_NoChatTemplate):
    """UTF-8 bytes as token ids 0..255; decoding replaces invalid byte sequences with U+FFFD.

    Args:
        vocab_size: the model's vocabulary when it has more than 256 ids (a checkpoint without a tokenizer);
            ids 256 and above stand for no byte, so decoding masks each to U+FFFD, as it does an invalid byte,
            and a stream of generated text never stops on one.
    """

    name = "bytes"
    eos_id: int | None = None

    def __init__(self, vocab_size: int = 256) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 256:
            raise InputError(f"a byte tokenizer has at least 256 ids; got vocab_size={vocab_size!r}")
        self._vocab_size = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InputError(f"encode expects a str; got {type(text).__name__}")
        return list(check_text(text).encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self._vocab_size]
        if bad:
            raise InputError(f"byte token ids must lie in [0, {self._vocab_size}); got {bad[:5]}")
        if self._vocab_size == 256:
            return bytes(ids).decode("utf-8", errors="replace")
        # 0xFF never occurs in UTF-8, so it decodes to exactly one U+FFFD wherever an id names no byte
        return bytes(i if i < 256 else 0xFF for i in ids).decode("utf-8", errors="replace")


class BPETokenizer(_NoChatTemplate):
    """A ``tokenizers.Tokenizer`` (GPT-2 byte-level BPE, or anything else that library reads).

    Args:
        tokenizer: the ``tokenizers.Tokenizer``.
        name: where it came from, for messages.
        eos_id: the end-of-text id (GPT-2's ``<|endoftext|>``), when the vocabulary has one.
    """

    def __init__(self, tokenizer: Any, *, name: str, eos_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.name = name
        self.eos_id = eos_id

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> BPETokenizer:
        """Read a ``tokenizer.json``."""
        from tokenizers import Tokenizer as HFTokenizer

        try:
            tokenizer = HFTokenizer.from_file(str(path))
        except Exception as error:  # the library raises plain Exceptions on malformed files
            raise CheckpointError(f"{str(path)!r} is not a readable tokenizer.json: {error}") from error
        return cls(tokenizer, name=str(path), eos_id=tokenizer.token_to_id("<|endoftext|>"))

    @classmethod
    def from_vocab(cls, vocab: str | os.PathLike[str], merges: str | os.PathLike[str]) -> BPETokenizer:
        """Rebuild GPT-2's byte-level BPE from ``vocab.json`` and ``merges.txt``."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, pre_tokenizers
        from tokenizers.models import BPE

        try:
            tokenizer = HFTokenizer(BPE.from_file(str(vocab), str(merges)))
        except Exception as error:
            raise CheckpointError(f"{str(vocab)!r} and {str(merges)!r} are not a BPE vocabulary: {error}") from error
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        return cls(tokenizer, name=str(vocab), eos_id=tokenizer.token_to_id("<|endoftext|>"))

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InputError(f"encode expects a str; got {type(text).__name__}")
        # encode_batch releases the GIL while it works (encode holds it: seconds for a megabyte prompt, during
        # which a server's event loop cannot answer anyone)
        return self.tokenizer.encode_batch([check_text(text)], add_special_tokens=False)[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; a partial multi-byte character decodes to U+FFFD."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def find_tokenizer(checkpoint: str | os.PathLike[str]) -> Path | None:
    """The tokenizer file that belongs to a checkpoint, or ``None``.

    Looked for, in order: ``<dir>/tokenizer.json`` for a directory (a Hugging Face model), and beside a file
    ``<stem>.tokenizer.json`` then ``tokenizer.json`` in the same directory; ``vocab.json`` (with ``merges.txt``)
    in the same places.
    """
    path = Path(checkpoint)
    folder = path if path.is_dir() else path.parent
    candidates = [] if path.is_dir() else [folder / f"{path.stem}.{TOKENIZER_FILE}"]
    candidates += [folder / TOKENIZER_FILE, folder / VOCAB_FILES[0]]
    return next((c for c in candidates if c.is_file()), None)


def load_tokenizer(
    checkpoint: str | os.PathLike[str] | None = None,
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    vocab_size: int | None = None,
) -> Tokenizer:
    """The tokenizer for a model: an explicit file, else one found beside the checkpoint, else bytes.

    Args:
        checkpoint: a oneblock checkpoint file or a Hugging Face model directory.
        tokenizer: a ``tokenizer.json`` or ``vocab.json`` to use instead of searching.
        vocab_size: the model's vocabulary; the tokenizer's ids must fit in it.

    Raises:
        CheckpointError: an explicit file that is missing or unreadable.
        InputError: a tokenizer with more ids than the model has (the wrong tokenizer for this model).
    """
    path: Path | None
    if tokenizer is not None:
        path = Path(tokenizer)
        if not path.is_file():
            raise CheckpointError(f"the tokenizer file {str(path)!r} does not exist")
    else:
        path = find_tokenizer(checkpoint) if checkpoint is not None else None
    if path is None:  # a larger model's ids past 255 decode to U+FFFD (see ByteTokenizer)
        result: Tokenizer = ByteTokenizer(max(vocab_size or 256, 256))
    elif path.name.endswith(VOCAB_FILES[0]):
        merges = path.with_name(VOCAB_FILES[1])
        if not merges.is_file():
            raise CheckpointError(f"{str(path)!r} needs {VOCAB_FILES[1]!r} beside it for byte-level BPE")
        result = BPETokenizer.from_vocab(path, merges)
    else:
        result = BPETokenizer.from_file(path)
    if vocab_size is not None and result.vocab_size > vocab_size:
        hint = (
            "the model is smaller than 256 ids: put its tokenizer.json beside the checkpoint or pass one"
            if path is None
            else "this tokenizer belongs to another model; pass the right one"
        )
        raise InputError(
            f"the tokenizer ({result.name}) has {result.vocab_size} ids but the model's vocab_size is {vocab_size}; "
            f"{hint}"
        )
    return result


class TextStream:
    """Decode generated ids as they come, emitting text only once it is complete, in constant time per token.

    Decoding one token at a time can cut a UTF-8 character (or, for byte-level BPE, a token) in half, which
    would print U+FFFD; decoding all ids so far at every token costs time quadratic in the length. The stream
    decodes a short window instead (as vLLM's incremental detokenizer does): the ids from ``prefix`` (already
    printed, kept as context for tokenizers whose text depends on the previous token) to the end, and prints what
    the window adds beyond the text of ``ids[prefix:read]``. Text ending in an incomplete character is held until
    the next token completes it, for at most ``HOLD`` tokens (a character has at most 4 bytes, a token at least
    one): beyond that the bytes are invalid and printed as U+FFFD, as the full decode would. The pieces join to
    ``tokenizer.decode(all ids)``.

    >>> stream = TextStream(ByteTokenizer())
    >>> stream.push([0xC3]), stream.push([0xA9])
    ('', 'é')
    """

    HOLD = 4

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids before this are printed and no longer decoded
        self.read = 0  # ids before this are printed

    def push(self, ids: Sequence[int]) -> str:
        """Add ids; return the new text that is ready."""
        self.ids.extend(int(i) for i in ids)
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if not text.endswith("\ufffd"):
            return self._advance(text, len(self.ids))
        if len(self.ids) - self.read <= self.HOLD:
            return ""  # possibly an unfinished character: wait for more
        # Invalid bytes: print up to the last cut whose text the whole window agrees with, keeping back the last
        # three ids unless they end a character (a character started there may still be completed).
        for end in range(len(self.ids) - 1, self.read, -1):
            head = self.tokenizer.decode(self.ids[self.prefix : end])
            if text.startswith(head) and (not head.endswith("\ufffd") or end <= len(self.ids) - 3):
                return self._advance(head, end)
        return ""

    def flush(self) -> str:
        """Whatever is left, complete or not (call once generation ends)."""
        return self._advance(self.tokenizer.decode(self.ids[self.prefix :]), len(self.ids))

    def _advance(self, text: str, end: int) -> str:
        """Print ``text``, the decoding of ``ids[prefix:end]``, beyond what was printed."""
        printed = self.tokenizer.decode(self.ids[self.prefix : self.read])
        self.prefix, self.read = self.read, end
        return text[len(printed) :]
