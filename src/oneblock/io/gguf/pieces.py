"""The decoding half of a GGUF file's tokenizer: each id's bytes, packed in one buffer.

Shape notation: V vocabulary size (added tokens included).

A ``tokenizers.Tokenizer`` holds its vocabulary both ways and every merge: about 36 MiB resident for Qwen2's
151,936 tokens, as much as a tenth of a 0.5B model's quantized weights. Turning ids back into text needs only each
id's bytes (about 2 MB for the same vocabulary), so ``oneblock generate`` encodes its prompt with the full tokenizer
and keeps :class:`TokenPieces` for the rest of the run. ``decode`` gives what the full tokenizer's does, character
for character: byte-level BPE maps each piece through the byte alphabet (a piece outside it stands for its own
UTF-8) and replaces invalid UTF-8 as Rust's ``from_utf8_lossy``; SentencePiece turns ``▁`` into a space, joins each
run of byte pieces (``<0x0A>``) into UTF-8, one U+FFFD per byte where a run is invalid, and drops the first space
where the vocabulary adds one.
"""

from __future__ import annotations

import string
from collections.abc import Sequence

import numpy as np

from oneblock.errors import InputError
from oneblock.io.gguf.tokenizer import GGUFTokenizer, byte_alphabet, outside_alphabet
from oneblock.text.tokenizer import EndOfTurn

_SPACE = "\u2581"  # SentencePiece's word start
_HEX = frozenset(string.hexdigits)
_SPAN = 4096  # ids per step of TokenPieces.of


def _byte_of_piece(piece: str) -> int | None:
    """The byte a SentencePiece byte piece (``<0x0A>``) stands for, by the rule the ``tokenizers`` decoder reads."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">") and set(piece[3:5]) <= _HEX:
        return int(piece[3:5], 16)
    return None


class TokenPieces(EndOfTurn):
    """Ids -> text for a GGUF file's vocabulary, without the encoder's maps.

    Build it with :meth:`of`; ``encode`` is refused (the full tokenizer encodes). ``stop_ids``, ``eos_id``,
    ``bos_id`` and ``name`` are the tokenizer's.
    """

    chat_template: str | None = None

    def __init__(
        self,
        blob: bytes,
        offsets: np.ndarray,
        special: np.ndarray,
        byte: np.ndarray | None,
        *,
        strip_space: bool,
        name: str,
        bos_id: int | None,
        eos_id: int | None,
        end_of_turn_ids: Sequence[int] = (),
    ) -> None:
        self.blob, self.offsets, self.special, self.byte = blob, offsets, special, byte  # (V + 1,), (V,), (V,)
        self.strip_space = strip_space
        self.name, self.bos_id, self.eos_id = name, bos_id, eos_id
        self.end_of_turn_ids = tuple(end_of_turn_ids)

    @classmethod
    def of(cls, tokenizer: GGUFTokenizer) -> TokenPieces:
        """The pieces of ``tokenizer``'s vocabulary (its ``tokenizers.Tokenizer`` may be dropped after), read
        ``_SPAN`` ids at a time, so that building them costs little more memory than they take."""
        inner = tokenizer.tokenizer
        size = tokenizer.vocab_size
        special = np.zeros(size, dtype=bool)
        for index, added in inner.get_added_tokens_decoder().items():
            if 0 <= index < size and added.special:
                special[index] = True
        blobs: list[bytes] = []
        lengths = np.zeros(size + 1, dtype=np.int64)
        byte = np.full(size, -1, dtype=np.int16) if tokenizer.sentencepiece else None
        table = {ord(char): value for value, char in byte_alphabet().items()}
        outside = outside_alphabet()  # a byte-level piece spelled outside the alphabet stands for its own UTF-8
        for start in range(0, size, _SPAN):
            pieces = [inner.id_to_token(index) or "" for index in range(start, min(start + _SPAN, size))]
            if byte is None and outside.search(joined := "".join(pieces)) is None:  # one byte per character
                lengths[start + 1 : start + 1 + len(pieces)] = [len(piece) for piece in pieces]
                blobs.append(joined.translate(table).encode("latin-1"))
                continue
            if byte is None:
                parts = [p.encode() if outside.search(p) else p.translate(table).encode("latin-1") for p in pieces]
            else:
                values = [_byte_of_piece(piece) for piece in pieces]
                byte[start : start + len(pieces)] = [-1 if v is None else v for v in values]
                texts = (p.replace(_SPACE, " ").encode() for p in pieces)
                parts = [text if v is None else bytes([v]) for text, v in zip(texts, values, strict=True)]
            lengths[start + 1 : start + 1 + len(parts)] = [len(part) for part in parts]
            blobs.append(b"".join(parts))
        return cls(
            b"".join(blobs), np.cumsum(lengths), special, byte,
            strip_space=byte is not None and _strips_space(tokenizer, special), name=tokenizer.name,
            bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, end_of_turn_ids=tokenizer.end_of_turn_ids,
        )  # fmt: skip

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return len(self.special)

    def encode(self, text: str) -> list[int]:
        raise InputError(f"the tokenizer of {self.name} was kept for decoding only; encode with the full tokenizer")

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids``, as the full tokenizer's ``decode`` gives it."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InputError(f"token ids {bad[:5]} are outside [0, {self.vocab_size})")
        if skip_special_tokens:
            ids = [i for i in ids if not self.special[i]]
        blob, offsets = self.blob, self.offsets
        if self.byte is None:
            return b"".join([blob[offsets[i] : offsets[i + 1]] for i in ids]).decode("utf-8", "replace")
        text: list[str] = []
        run = bytearray()  # consecutive byte pieces
        for i in ids:
            if self.byte[i] >= 0:
                run.append(int(self.byte[i]))
                continue
            if run:
                text.append(_utf8_or_replacements(run))
                run.clear()
            text.append(blob[offsets[i] : offsets[i + 1]].decode())
        if run:
            text.append(_utf8_or_replacements(run))
        joined = "".join(text)
        return joined[1:] if self.strip_space and joined.startswith(" ") else joined


def _utf8_or_replacements(run: bytearray) -> str:
    """A run of byte pieces as UTF-8, or one U+FFFD per byte where it is not valid (the ``ByteFallback`` rule)."""
    try:
        return run.decode()
    except UnicodeDecodeError:
        return "\ufffd" * len(run)


def _strips_space(tokenizer: GGUFTokenizer, special: np.ndarray) -> bool:
    """Whether the SentencePiece decoder drops one leading space (vocabularies that add a space prefix): asked of
    the decoder itself, with the first ordinary piece that starts a word."""
    for index in range(len(special)):
        piece = tokenizer.tokenizer.id_to_token(index) or ""
        if len(piece) > 1 and piece[0] == _SPACE and piece[1] not in (_SPACE, " ") and not special[index]:
            return not tokenizer.tokenizer.decode([index]).startswith(" ")
    return False
