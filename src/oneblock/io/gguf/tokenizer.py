"""The tokenizer and chat template stored in a GGUF file.

A GGUF file carries no ``tokenizer.json``; llama.cpp stores the pieces as metadata instead:
``tokenizer.ggml.model`` (the algorithm; ``"gpt2"`` means byte-level BPE), ``tokens`` (id -> token string),
``merges`` (the BPE merge list, best first), ``token_type`` (1 normal, 3 control such as ``<|im_end|>``,
4 user-defined), ``pre`` (which regex splits text into words before BPE), the special ids, and
``tokenizer.chat_template`` (a Jinja template that turns a list of messages into one prompt string).
:class:`GGUFTokenizer` reassembles them into a ``tokenizers.Tokenizer``.

Byte-level BPE (Radford et al., 2019, GPT-2): every UTF-8 byte is first mapped to a printable character
(space -> ``Ġ``, newline -> ``Ċ``), so any text, emoji included, is spelled with the base alphabet and the merges
build longer tokens from there; nothing is ever "unknown". SentencePiece vocabularies (``"llama"``: Llama 2, Phi-3,
Gemma) are built by :mod:`oneblock.io.gguf.spm`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders
from tokenizers.models import BPE

from oneblock.errors import ConversionError, InputError
from oneblock.io.gguf.file import check_merges, field_value, is_reader
from oneblock.io.gguf.layout import GGUFLayout, read_layout
from oneblock.io.gguf.pretokenizers import PRE_TOKENIZERS
from oneblock.io.gguf.spm import SPACE, piece_byte, spm_from_metadata
from oneblock.text.checks import check_text
from oneblock.text.tokenizer import EndOfTurn

if TYPE_CHECKING:
    from gguf import GGUFReader

_CONTROL = 3
_USER_DEFINED = 4
VOCABULARY_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
)
"""The metadata a tokenizer is built from and nothing else reads: one entry per token (or merge) each."""


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character: printable Latin-1 maps to itself, the other bytes
    (controls, space, ...) to the characters from U+0100 on, in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def _byte_values() -> dict[str, int]:
    """The byte alphabet read backwards: printable character -> byte."""
    return {c: b for b, c in byte_alphabet().items()}


@lru_cache(maxsize=1)
def outside_alphabet() -> re.Pattern[str]:
    """Matches a character outside the byte alphabet: one C-level scan per token instead of a Python set."""
    return re.compile("[^" + re.escape("".join(byte_alphabet().values())) + "]")


def _spelled(token: str) -> str:
    """A vocabulary entry in the byte alphabet. A few files store special tokens in plain UTF-8 instead."""
    if outside_alphabet().search(token) is None:
        return token
    table = byte_alphabet()
    return "".join(table[b] for b in token.encode("utf-8"))


# The bytes of ordinary text: tab, newline, carriage return, printable ASCII, UTF-8 continuation bytes, and the lead
# bytes of every character up to U+3FFFF (all scripts, symbols and emoji). Real vocabularies lack some of the
# others: SmolLM2's has no token for 0x04 or 0x1d (control characters), 0xc0, 0xc1 and 0xf5-0xff (never in UTF-8)
# or 0xf1-0xf2 (unassigned planes); like transformers and llama.cpp, encoding drops such a byte.
TEXT_BYTES = frozenset([0x09, 0x0A, 0x0D, *range(0x20, 0x7F), *range(0x80, 0xC0), *range(0xC2, 0xF1)])


def check_byte_vocabulary(tokens: Sequence[str]) -> None:
    """Refuse a byte-level vocabulary that cannot spell ordinary text: one missing a token for any byte of
    ``TEXT_BYTES``, or holding one token twice (which id would the text get?). Without this check a vocabulary
    of ``<x0>``...``<x255>`` encodes ``"hello world"`` to ``[]``, silently.

    Raises:
        ConversionError: naming the first missing bytes or the first duplicate and its ids.
    """
    present = set(tokens)  # as stored: a byte symbol is spelled the same either way
    if len(present) != len(tokens):  # some token twice: find the first, for the message
        first: dict[str, int] = {}
        for index, token in enumerate(tokens):
            if token in first:
                raise ConversionError(
                    f"the GGUF vocabulary holds {token!r} twice (ids {first[token]} and {index}); a byte-level "
                    "BPE vocabulary has each token once: the file is corrupt"
                )
            first[token] = index
    alphabet = byte_alphabet()
    missing = [b for b in sorted(TEXT_BYTES) if alphabet[b] not in present]
    if missing:
        shown = ", ".join(f"{b:#04x} ({alphabet[b]!r})" for b in missing[:5])
        raise ConversionError(
            f"the GGUF vocabulary cannot spell {len(missing)} of the {len(TEXT_BYTES)} bytes of ordinary text "
            f"(first: {shown}): a byte-level BPE vocabulary has a token for each, or texts lose characters when "
            "encoded; the file is corrupt"
        )


def build_tokenizer(
    tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int], pre: str | None
) -> Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` from the vocabulary a GGUF file stores.

    Args:
        tokens: the vocabulary; ``tokens[i]`` is the string of id ``i``.
        merges: ``"left right"`` pairs, highest priority first.
        token_types: llama.cpp's type of each token; control tokens (3) become special added tokens, matched
            whole in any text and dropped by ``decode(..., skip_special_tokens=True)``; user-defined ones (4)
            become ordinary added tokens.
        pre: ``tokenizer.ggml.pre``, naming the word-splitting regex.

    Raises:
        ConversionError: for an unknown ``pre`` or a malformed merge.
    """
    key = pre or "default"
    if key not in PRE_TOKENIZERS:
        raise ConversionError(
            f"tokenizer.ggml.pre={pre!r} names a word-splitting rule oneblock does not know; "
            f"known: {sorted(PRE_TOKENIZERS)}"
        )
    alphabet = set(byte_alphabet().values())
    if outside_alphabet().search("".join(tokens)) is None:  # one scan: every token already in the alphabet
        vocab = dict(zip(tokens, range(len(tokens)), strict=True))
    else:
        vocab = {_spelled(token): index for index, token in enumerate(tokens)}
    pairs = _merge_pairs(merges)
    check_merges(pairs, vocab)
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[key]()
    tokenizer.decoder = decoders.ByteLevel()
    kinds = np.asarray(token_types)
    if kinds.shape != (len(tokens),):
        raise ConversionError(f"{kinds.size} token types for {len(tokens)} tokens; the tokenizer is corrupt")
    # A control token spelled outside the byte alphabet would be a mislabelled entry: skip it, as llama.cpp
    # never emits it from text either.
    specials = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i in np.flatnonzero(kinds == _CONTROL).tolist()
        if set(tokens[i]) <= alphabet
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i in np.flatnonzero(kinds == _USER_DEFINED).tolist()
        if tokens[i] in vocab
    ]
    tokenizer.add_special_tokens(specials)
    tokenizer.add_tokens(user)
    return tokenizer


def _merge_pairs(merges: Sequence[str]) -> list[tuple[str, str]]:
    """``"left right"`` strings as ``(left, right)`` pairs: split all at once, and checked by joining them back.

    Raises:
        ConversionError: naming the first merge that is not two tokens separated by one space.
    """
    parts = " ".join(merges).split(" ")
    if len(parts) == 2 * len(merges):
        pairs = list(zip(parts[0::2], parts[1::2], strict=True))
        if list(map(" ".join, pairs)) == list(merges):  # then each merge held exactly one space
            return pairs
    pairs = []
    for merge in merges:
        split = merge.split(" ")
        if len(split) != 2:
            raise ConversionError(f"BPE merge {merge!r} is not two tokens separated by one space")
        pairs.append((split[0], split[1]))
    return pairs


def _bpe_from_metadata(meta: Mapping[str, Any]) -> Tokenizer:
    """The byte-level BPE tokenizer of a GGUF file's ``tokenizer.*`` metadata."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ConversionError("the GGUF file has an empty tokenizer.ggml.tokens vocabulary")
    check_byte_vocabulary(tokens)
    types = meta.get("tokenizer.ggml.token_type")
    types = [1] * len(tokens) if types is None or len(types) == 0 else types
    if len(types) != len(tokens):
        raise ConversionError(
            f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens; the file is corrupt"
        )
    return build_tokenizer(tokens, meta.get("tokenizer.ggml.merges") or [], types, meta.get("tokenizer.ggml.pre"))


def _end_of_turn_ids(meta: Mapping[str, Any], vocab_size: int) -> list[int]:
    """The file's end-of-turn and end-of-message ids; one outside the vocabulary is left out, as llama.cpp does."""
    ids = (meta.get(f"tokenizer.ggml.{name}_token_id") for name in ("eot", "eom"))
    return [i for i in ids if isinstance(i, int) and 0 <= i < vocab_size]


class GGUFTokenizer(EndOfTurn):
    """The tokenizer of a GGUF file: text <-> token ids, plus its chat template.

    Build it with :meth:`from_gguf`. ``encode`` matches special tokens written in the text (``<|im_start|>``
    becomes one id), which is what a rendered chat prompt needs. ``stop_ids`` are ``eos_id`` and the file's
    end-of-turn ids (``tokenizer.ggml.eot_token_id``, ``eom_token_id``): Llama 3's ``<|eot_id|>`` and
    ``<|eom_id|>`` beside its ``<|end_of_text|>``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        name: str = "gguf",
        sentencepiece: bool = False,
        end_of_turn_ids: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.end_of_turn_ids = tuple(int(i) for i in end_of_turn_ids)
        self.name = name
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.sentencepiece = sentencepiece

    @classmethod
    def from_gguf(cls, source: str | os.PathLike[str] | GGUFLayout | GGUFReader) -> GGUFTokenizer:
        """Read the tokenizer from a GGUF file (a path, its parsed layout, or a ``gguf.GGUFReader``).

        Raises:
            CheckpointError: if the file is missing, not GGUF or corrupt.
            ConversionError: if the file has no vocabulary, one that is neither byte-level BPE nor SentencePiece,
                or one that cannot spell every byte of ordinary text.
        """
        if isinstance(source, GGUFLayout):
            meta = source.metadata
        elif is_reader(source):
            keys = [key for key in source.fields if key.startswith("tokenizer.") or key == "general.name"]
            meta = {key: field_value(source, key) for key in keys}
        else:
            meta = read_layout(source).metadata
        model = meta.get("tokenizer.ggml.model")
        if model == "gpt2":
            tokenizer = _bpe_from_metadata(meta)
        elif model == "llama":
            tokenizer = spm_from_metadata(meta)
        else:
            raise ConversionError(
                f"tokenizer.ggml.model={model!r} is not supported; oneblock reads byte-level BPE ('gpt2': SmolLM, "
                "Llama 3, Qwen) and SentencePiece ('llama': Llama 2, Phi-3, Gemma) vocabularies"
            )
        return cls(
            tokenizer,
            bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_id=meta.get("tokenizer.ggml.eos_token_id"),
            pad_id=meta.get("tokenizer.ggml.padding_token_id"),
            # llama.cpp's default: SentencePiece vocabularies start with bos, byte-level BPE ones do not
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
            chat_template=meta.get("tokenizer.chat_template"),
            name=str(source.path) if isinstance(source, GGUFLayout) else str(getattr(source, "path", source)),
            sentencepiece=model == "llama",
            end_of_turn_ids=_end_of_turn_ids(meta, tokenizer.get_vocab_size(with_added_tokens=True)),
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token(self, token_id: int) -> str | None:
        """The vocabulary string of one id (in the byte alphabet, or a SentencePiece piece such as ``▁Hello``), or
        None if out of range."""
        return self.tokenizer.id_to_token(token_id)

    def piece_bytes(self, token_id: int) -> bytes | None:
        """The bytes one id adds to a text (a SentencePiece ``▁`` as a space, ``<0x0A>`` as its byte, a byte-level
        piece through the byte alphabet), or None if out of range."""
        piece = self.token(token_id)
        if piece is None:
            return None
        if self.sentencepiece:
            byte = piece_byte(piece)
            return piece.replace(SPACE, " ").encode("utf-8") if byte is None else bytes([byte])
        table = _byte_values()
        return bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode("utf-8")

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``.

        Args:
            text: any string; special tokens written in it are matched whole.
            add_bos: prepend ``bos_id``; ``None`` follows the file's ``tokenizer.ggml.add_bos_token``.
        """
        if not isinstance(text, str):
            raise InputError(f"encode expects a str; got {type(text).__name__}")
        # encode_batch releases the GIL while it works (encode holds it: seconds for a megabyte prompt, during
        # which a server's event loop could not answer anyone); the ids are the same.
        ids = self.tokenizer.encode_batch([check_text(text)], add_special_tokens=False)[0].ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; invalid UTF-8 from a partial multi-byte character decodes to U+FFFD."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InputError(f"token ids {bad[:5]} are outside [0, {self.vocab_size})")
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def special_tokens(self) -> dict[str, str]:
        """``bos_token``, ``eos_token``, ``pad_token`` as strings, the names chat templates read."""
        names = {"bos_token": self.bos_id, "eos_token": self.eos_id, "pad_token": self.pad_id}
        return {name: token for name, i in names.items() if i is not None and (token := self.token(i)) is not None}

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str | list[int]:
        """Render ``messages`` with the file's chat template (``tools``, when given, as its ``tools`` variable);
        with ``tokenize=True`` return the ids.

        Raises:
            ConversionError: if the file has no ``tokenizer.chat_template``.
        """
        if not self.chat_template:
            raise ConversionError("this GGUF file has no tokenizer.chat_template; pass one to render_chat")
        from oneblock.text.chat_template import render_chat  # its module and jinja2 only when a chat is rendered

        text = render_chat(
            messages,
            template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens(),
            **({} if tools is None else {"tools": [dict(tool) for tool in tools]}),
        )
        return self.encode(text, add_bos=False) if tokenize else text
