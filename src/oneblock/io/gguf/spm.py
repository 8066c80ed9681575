"""SentencePiece vocabularies in a GGUF file (``tokenizer.ggml.model = "llama"``): Llama 2, Phi-3, Gemma.

Such a file stores, for each id, the piece (spaces spelled ``▁``, U+2581), a score and a type (1 normal, 2 unknown,
3 control, 4 user-defined, 6 byte: ``<0x0A>`` stands for one byte). llama.cpp's ``llm_tokenizer_spm`` encodes a
text as SentencePiece's BPE does (Kudo and Richardson, 2018): spaces become ``▁``, a space is put in front when
``tokenizer.ggml.add_space_prefix`` is true (the default), the text is cut into UTF-8 characters, and the adjacent
pair whose joined piece is in the vocabulary with the highest score is merged, again and again (ties: the leftmost
pair); a character left without a piece is spelled by its byte tokens.

``tokenizers`` runs the same loop as BPE if each vocabulary piece becomes one merge per way of cutting it into two
pieces, ranked by the joined piece's score (transformers converts a ``LlamaTokenizer`` the same way).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, normalizers
from tokenizers.models import BPE

from oneblock.errors import ConversionError

SPACE = "\u2581"  # SentencePiece's spelling of a space: "▁"
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4
# Bytes that ordinary text needs a byte token for (tab, newline, carriage return, printable ASCII, and every byte
# of a UTF-8 character up to U+3FFFF): llama.cpp stops with an error on a byte it cannot spell.
_TEXT_BYTES = (0x09, 0x0A, 0x0D, *range(0x20, 0x7F), *range(0x80, 0xC0), *range(0xC2, 0xF1))


def byte_piece(byte: int) -> str:
    """The piece of one byte: ``<0x0A>`` for a newline."""
    return f"<0x{byte:02X}>"


def piece_byte(piece: str) -> int | None:
    """The byte a byte token such as ``<0x0A>`` stands for, or None for any other piece."""
    if len(piece) != 6 or not piece.startswith("<0x"):
        return None
    try:
        value = int(piece[3:5], 16)
    except ValueError:
        return None
    return value if byte_piece(value) == piece else None


def _vocabulary(tokens: Sequence[str]) -> dict[str, int]:
    """Piece -> id, each piece once, with a byte token for every byte of ordinary text.

    Raises:
        ConversionError: naming the first duplicate piece and its ids, or the first missing byte tokens.
    """
    vocab = dict(zip(tokens, range(len(tokens)), strict=True))
    if len(vocab) != len(tokens):
        first: dict[str, int] = {}
        for index, token in enumerate(tokens):
            if token in first:
                raise ConversionError(
                    f"the GGUF vocabulary holds {token!r} twice (ids {first[token]} and {index}); a SentencePiece "
                    "vocabulary has each piece once: the file is corrupt"
                )
            first[token] = index
    missing = [byte_piece(b) for b in _TEXT_BYTES if byte_piece(b) not in vocab]
    if missing:
        raise ConversionError(
            f"the SentencePiece vocabulary has no byte token for {len(missing)} of the {len(_TEXT_BYTES)} bytes of "
            f"ordinary text (first: {', '.join(missing[:5])}); oneblock, like llama.cpp, needs a byte-fallback "
            "vocabulary to spell characters without a piece"
        )
    return vocab


def spm_merges(vocab: dict[str, int], scores: np.ndarray) -> list[tuple[str, str]]:
    """The BPE merges equivalent to merging by score: ``(left, right)`` for every piece that splits into two pieces,
    the highest-scoring joined piece first (equal scores: the lower id first, then the shorter left part)."""
    pieces = sorted(vocab, key=len, reverse=True)
    lengths = [-len(piece) for piece in pieces]  # ascending, for bisect
    found: list[tuple[str, str, str]] = []  # (piece, left, right)
    for cut in range(1, -lengths[0] if lengths else 0):
        longer = pieces[: bisect_left(lengths, -cut)]  # the pieces longer than cut characters
        found += [(p, left, right) for p in longer if (left := p[:cut]) in vocab and (right := p[cut:]) in vocab]
    ids = np.fromiter(map(vocab.__getitem__, [p for p, _, _ in found]), dtype=np.int64, count=len(found))
    order = np.lexsort((ids, -scores[ids]))  # stable: the same piece keeps its cuts in order, shorter left first
    return [found[i][1:] for i in order.tolist()]


def build_spm_tokenizer(
    tokens: Sequence[str],
    scores: Sequence[float] | np.ndarray,
    token_types: Sequence[int] | np.ndarray,
    *,
    add_space_prefix: bool = True,
    unk_id: int = 0,
    rstrip_specials: bool = False,
) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` that encodes as llama.cpp's SentencePiece tokenizer does.

    Args:
        tokens: the pieces; ``tokens[i]`` is the piece of id ``i``.
        scores: one score per piece (a higher score merges first).
        token_types: llama.cpp's type of each piece. Control (3) and unknown (2) pieces become special added
            tokens, user-defined ones (4) ordinary added tokens: both are matched whole in any text, and, as in
            llama.cpp, the text after one of them gets its own leading space when ``add_space_prefix`` is true.
        add_space_prefix: put a space in front of the text (and after each added token), and take one off the
            front of a decoded text.
        unk_id: the id of the unknown piece (used for a byte without a byte token).
        rstrip_specials: the added tokens swallow the spaces after them (llama.cpp does this for Phi-3, except
            for ``<unk>``, ``<s>`` and ``<|endoftext|>``).

    Raises:
        ConversionError: for a vocabulary with a duplicate piece or without byte tokens, or scores, types or
            ``unk_id`` that do not fit it.
    """
    n = len(tokens)
    score = np.asarray(scores, dtype=np.float32)
    kinds = np.asarray(token_types)
    if score.shape != (n,) or kinds.shape != (n,):
        raise ConversionError(
            f"{score.size} scores and {kinds.size} token types for {n} tokens; each piece needs one of each: "
            "the tokenizer is corrupt"
        )
    if not 0 <= unk_id < n:
        raise ConversionError(f"tokenizer.ggml.unknown_token_id={unk_id} is outside the vocabulary [0, {n})")
    vocab = _vocabulary(tokens)
    model = BPE(
        vocab=vocab, merges=spm_merges(vocab, score), unk_token=tokens[unk_id], fuse_unk=True, byte_fallback=True
    )
    tokenizer = Tokenizer(model)
    spaces = normalizers.Replace(" ", SPACE)
    # Added tokens are cut out of the text before normalising, so Prepend adds the space per fragment, as llama.cpp.
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if add_space_prefix else spaces
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if add_space_prefix else steps)
    keep = {"<unk>", "<s>", "<|endoftext|>"}

    def added(index: int, special: bool) -> AddedToken:
        strip = rstrip_specials and tokens[index] not in keep
        return AddedToken(tokens[index], special=special, normalized=False, rstrip=strip)

    special = np.flatnonzero((kinds == _CONTROL) | (kinds == _UNKNOWN)).tolist()
    tokenizer.add_special_tokens([added(i, True) for i in special if tokens[i]])
    tokenizer.add_tokens([added(i, False) for i in np.flatnonzero(kinds == _USER_DEFINED).tolist() if tokens[i]])
    return tokenizer


def spm_from_metadata(meta: Mapping[str, Any]) -> Tokenizer:
    """The SentencePiece tokenizer of a GGUF file's ``tokenizer.*`` metadata (and ``general.name``, which tells
    llama.cpp to give Phi-3's added tokens their right strip).

    Raises:
        ConversionError: for an empty vocabulary or metadata that does not fit it (see :func:`build_spm_tokenizer`).
    """
    tokens = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ConversionError("the GGUF file has an empty tokenizer.ggml.tokens vocabulary")
    scores = meta.get("tokenizer.ggml.scores")
    types = meta.get("tokenizer.ggml.token_type")
    try:  # llama.cpp reads a missing list as all zero scores and all normal tokens
        score = np.zeros(len(tokens), np.float32) if scores is None else np.asarray(scores, dtype=np.float32)
        kinds = np.ones(len(tokens), np.int32) if types is None else np.asarray(types, dtype=np.int32)
    except (TypeError, ValueError):
        raise ConversionError(
            "tokenizer.ggml.scores must be numbers and tokenizer.ggml.token_type integers; the file is corrupt"
        ) from None
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
    if not isinstance(prefix, bool):
        raise ConversionError(f"tokenizer.ggml.add_space_prefix must be a bool; got {prefix!r}")
    if not isinstance(unk, int) or isinstance(unk, bool):
        raise ConversionError(f"tokenizer.ggml.unknown_token_id must be an integer; got {unk!r}")
    name = str(meta.get("general.name") or "").lower()
    return build_spm_tokenizer(
        tokens, score, kinds, add_space_prefix=prefix, unk_id=unk, rstrip_specials="phi-3" in name or "phi3" in name
    )
