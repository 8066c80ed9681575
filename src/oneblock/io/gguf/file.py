"""Opening a GGUF file and reading its metadata, with errors that say what is wrong with the file.

A GGUF file is a small header (magic ``b"GGUF"``, version, counts), a list of typed key/value metadata
(``general.architecture``, ``llama.block_count``, the tokenizer's vocabulary, the chat template, ...), a table of
tensor descriptions, and the aligned tensor data. ``gguf.GGUFReader`` memory-maps it (imported only by the
functions that take a reader: oneblock's own reader is :mod:`oneblock.io.gguf.layout`); this module turns the
reader's exceptions into ``CheckpointError``s and its fields into plain Python values, each checked against the
type its key must have (``TYPED_KEYS``): a string ``block_count`` or a negative ``context_length`` is refused by
name here, before any code computes with it.
"""

from __future__ import annotations

import math
import os
import sys
from itertools import chain, repeat, starmap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from oneblock.errors import CheckpointError

if TYPE_CHECKING:
    from gguf import GGUFReader
    from typing_extensions import TypeIs

GGUF_MAGIC = b"GGUF"
_HEADER_BYTES = 24  # magic (4) + version (4) + tensor count (8) + metadata count (8)

# Key (or, after a dot, the end of a key: "llama.block_count" ends with ".block_count") -> the type it must have.
# "count" is a non-negative integer; "number" a finite int or float.
TYPED_KEYS: dict[str, str] = {
    ".block_count": "count",
    ".context_length": "count",
    ".embedding_length": "count",
    ".feed_forward_length": "count",
    ".attention.head_count": "count",
    ".attention.head_count_kv": "count",
    ".attention.key_length": "count",
    ".attention.value_length": "count",
    ".rope.dimension_count": "count",
    ".vocab_size": "count",
    ".expert_count": "count",
    ".attention.layer_norm_rms_epsilon": "number",
    ".attention.layer_norm_epsilon": "number",
    ".rope.freq_base": "number",
    "general.architecture": "str",
    "general.name": "str",
    "tokenizer.ggml.model": "str",
    "tokenizer.ggml.pre": "str",
    "tokenizer.chat_template": "str",
    "tokenizer.ggml.bos_token_id": "count",
    "tokenizer.ggml.eos_token_id": "count",
    "tokenizer.ggml.eot_token_id": "count",
    "tokenizer.ggml.eom_token_id": "count",
    "tokenizer.ggml.padding_token_id": "count",
    "tokenizer.ggml.unknown_token_id": "count",
    "tokenizer.ggml.add_bos_token": "bool",
    "tokenizer.ggml.add_eos_token": "bool",
    "tokenizer.ggml.tokens": "list[str]",
    "tokenizer.ggml.merges": "list[str]",
    "tokenizer.ggml.token_type": "list[int]",
}


def check_gguf_file(path: Path) -> int:
    """The size of ``path`` in bytes, once it is known to be a regular file that starts like a GGUF file.

    Raises:
        CheckpointError: if the path is missing, a directory, too short for a header, or not GGUF.
    """
    if not path.exists():
        raise CheckpointError(f"GGUF file not found: {str(path)!r}")
    if not path.is_file():
        raise CheckpointError(f"expected a GGUF file, got a directory or special file: {str(path)!r}")
    size = path.stat().st_size
    if size < _HEADER_BYTES:
        raise CheckpointError(
            f"{str(path)!r} is {size} bytes long, too short for a GGUF header ({_HEADER_BYTES} bytes); "
            "the file is empty or truncated"
        )
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{str(path)!r} is not a GGUF file: it starts with {magic!r}, expected {GGUF_MAGIC!r}")
    return size


def is_reader(source: object) -> TypeIs[GGUFReader]:
    """Whether ``source`` is a ``gguf.GGUFReader``, without importing the package: whoever holds a reader has
    imported it already."""
    package = sys.modules.get("gguf")
    reader = getattr(package, "GGUFReader", None)
    return isinstance(reader, type) and isinstance(source, reader)


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """Memory-map a GGUF file.

    Args:
        path: the ``.gguf`` file.

    Returns:
        A ``gguf.GGUFReader``; tensor data stays on disk until read.

    Raises:
        CheckpointError: if the path is missing, a directory, too short, not GGUF, or corrupt.
    """
    from gguf import GGUFReader

    path = Path(path)
    check_gguf_file(path)
    try:
        return GGUFReader(path)
    except OSError as error:
        raise CheckpointError(f"cannot read {str(path)!r}: {error.strerror or error}") from None
    except Exception as error:  # the reader parses untrusted bytes: whatever it raises means a corrupt file
        raise CheckpointError(
            f"{str(path)!r} is a corrupt or truncated GGUF file: {type(error).__name__}: {error}"
        ) from None


def field_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """One metadata value as Python data: ``int``, ``float``, ``bool``, ``str`` or a list of them.

    Args:
        reader: an open file.
        key: the metadata key, e.g. ``"llama.block_count"``.
        default: returned when the key is absent.

    Raises:
        CheckpointError: the value cannot be read, or is not of the type ``TYPED_KEYS`` gives its key.
    """
    field = reader.get_field(key)
    if field is None:
        return default
    try:
        value = field.contents()
    except Exception as error:  # a damaged field: offsets or types that do not fit
        raise CheckpointError(f"GGUF metadata {key!r} cannot be read: {type(error).__name__}: {error}") from None
    return checked_value(key, value)


def checked_value(key: str, value: Any) -> Any:
    """``value`` if it has the type ``TYPED_KEYS`` gives ``key`` (any value of a key it does not know).

    Raises:
        CheckpointError: naming the key, the type it must have and the value found.
    """
    kind = expected_type(key)
    if kind is not None and not _has_type(value, kind):
        shown = f"a list starting {list(value[:3])!r}" if isinstance(value, (list, np.ndarray)) else repr(value)
        raise CheckpointError(f"GGUF metadata {key!r} must be {_WORDS[kind]}; got {shown}; the file is corrupt")
    return value


def expected_type(key: str) -> str | None:
    """The type ``TYPED_KEYS`` requires of ``key``, or None for a key it does not know."""
    if key in TYPED_KEYS:
        return TYPED_KEYS[key]
    return next((kind for suffix, kind in TYPED_KEYS.items() if suffix[0] == "." and key.endswith(suffix)), None)


_WORDS = {
    "count": "a non-negative integer",
    "number": "a finite number",
    "str": "a string",
    "bool": "true or false",
    "list[str]": "a list of strings",
    "list[int]": "a list of integers",
}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _has_type(value: Any, kind: str) -> bool:
    if kind == "count":
        return _is_int(value) and value >= 0
    if kind == "number":
        return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
    if kind == "str":
        return isinstance(value, str)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "list[str]":
        return isinstance(value, list) and all(map(isinstance, value, repeat(str)))
    if isinstance(value, np.ndarray):  # numeric arrays of a parsed layout stay views of the file
        return value.dtype.kind in "iu"
    return isinstance(value, list) and all(_is_int(v) for v in value)


def read_metadata(reader: GGUFReader, *, skip_arrays_longer_than: int | None = 1024) -> dict[str, Any]:
    """Every metadata key and value, except the header's own bookkeeping (``GGUF.*``).

    Args:
        reader: an open file.
        skip_arrays_longer_than: long arrays (the vocabulary, merges, token types) are read only on request
            with :func:`field_value`, since turning 50,000 strings into Python objects takes a while;
            ``None`` reads everything.
    """
    from gguf import GGUFValueType

    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        is_array = bool(field.types) and field.types[0] == GGUFValueType.ARRAY
        if is_array and skip_arrays_longer_than is not None and len(field.data) > skip_arrays_longer_than:
            continue
        out[key] = field_value(reader, key)
    return out


def check_merges(pairs: list[tuple[str, str]], vocab: dict[str, int]) -> None:
    """Refuse BPE merges whose parts, or whose result, are not in the vocabulary (the tokenizers library would
    raise a raw error, or build a tokenizer that emits ids that do not exist)."""
    from oneblock.errors import ConversionError

    if vocab.keys() >= set(chain.from_iterable(pairs)) and all(map(vocab.__contains__, starmap(str.__add__, pairs))):
        return  # all found, in one pass of C loops; otherwise find the first missing piece, for the message
    for rank, (left, right) in enumerate(pairs):
        for piece in (left, right, left + right):
            if piece not in vocab:
                raise ConversionError(
                    f"BPE merge {rank} ({left!r} {right!r}) uses {piece!r}, which is not in the vocabulary of "
                    f"{len(vocab)} tokens; the GGUF tokenizer is corrupt"
                )
