"""Opening a GGUF file and reading its metadata, with errors that say what is wrong with the file.

A GGUF file is a small header (magic ``b"GGUF"``, version, counts), a list of typed key/value metadata
(``general.architecture``, ``llama.block_count``, the tokenizer's vocabulary, the chat template, ...), a table of
tensor descriptions, and the aligned tensor data. ``gguf.GGUFReader`` memory-maps it; this module turns the
reader's exceptions into ``CheckpointError``s and its fields into plain Python values.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gguf import GGUFReader, GGUFValueType

from oneblock.errors import CheckpointError

GGUF_MAGIC = b"GGUF"
_HEADER_BYTES = 24  # magic (4) + version (4) + tensor count (8) + metadata count (8)


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """Memory-map a GGUF file.

    Args:
        path: the ``.gguf`` file.

    Returns:
        A ``gguf.GGUFReader``; tensor data stays on disk until read.

    Raises:
        CheckpointError: if the path is missing, a directory, too short, not GGUF, or corrupt.
    """
    path = Path(path)
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
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, TypeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{str(path)!r} is a corrupt or truncated GGUF file: {error}") from error


def field_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """One metadata value as Python data: ``int``, ``float``, ``bool``, ``str`` or a list of them.

    Args:
        reader: an open file.
        key: the metadata key, e.g. ``"llama.block_count"``.
        default: returned when the key is absent.
    """
    field = reader.get_field(key)
    if field is None:
        return default
    return field.contents()


def read_metadata(reader: GGUFReader, *, skip_arrays_longer_than: int | None = 1024) -> dict[str, Any]:
    """Every metadata key and value, except the header's own bookkeeping (``GGUF.*``).

    Args:
        reader: an open file.
        skip_arrays_longer_than: long arrays (the vocabulary, merges, token types) are read only on request
            with :func:`field_value`, since turning 50,000 strings into Python objects takes a while;
            ``None`` reads everything.
    """
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        is_array = bool(field.types) and field.types[0] == GGUFValueType.ARRAY
        if is_array and skip_arrays_longer_than is not None and len(field.data) > skip_arrays_longer_than:
            continue
        out[key] = field_value(reader, key)
    return out
