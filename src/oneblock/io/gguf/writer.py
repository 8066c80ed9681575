"""Writing a GGUF file the way oneblock writes every file: atomically, with a digest of all of its bytes.

``gguf.GGUFWriter`` (the package llama.cpp ships) lays out the header, the typed metadata, the tensor table and the
aligned data. It writes to a temporary name beside the target; the string ``oneblock.sha256``, the first metadata
key after the architecture, is written as 64 zeros, then replaced by the SHA-256 of the whole file (zeros in
place), and the file is flushed and renamed over the target. A reader that finds the key checks the digest
(:func:`oneblock.io.gguf.layout.verify_digest`); llama.cpp ignores keys it does not know.

``typed_metadata`` re-reads a file's metadata with the GGUF type of each value, so that keys copied from another
file (the tokenizer, the chat template) keep exactly the types llama.cpp expects of them.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from oneblock.errors import CheckpointError, OneBlockError
from oneblock.io import limits
from oneblock.io.files import check_destination, describe_os_error, fsync_directory
from oneblock.io.gguf.cursor import Cursor
from oneblock.io.gguf.layout import DIGEST_WITHIN, read_layout
from oneblock.io.integrity import DIGEST_KEY, PLACEHOLDER

_ARRAY = 9


@dataclass(frozen=True)
class Entry:
    """One metadata key/value with its GGUF type (``GGUFValueType`` ids; ``item`` for arrays)."""

    key: str
    value: Any
    vtype: int
    item: int | None = None


@dataclass(frozen=True)
class TensorData:
    """One tensor to write: its GGUF name, its values (float32/float16 array, or the bytes of a quantized type in
    a uint8 array of shape (rows, bytes per row)), and its ``GGMLQuantizationType`` when quantized."""

    name: str
    array: np.ndarray
    qtype: int | None = None


def typed_metadata(path: str | os.PathLike[str], prefixes: Sequence[str]) -> list[Entry]:
    """The metadata entries of a GGUF file whose keys start with one of ``prefixes``, with their GGUF types.

    Raises:
        CheckpointError: the file is missing, not GGUF or corrupt.
    """
    layout = read_layout(path)  # checks the whole file first
    if layout.mapped is None:
        raise CheckpointError(f"{str(path)!r} was not mapped; its metadata cannot be re-read")
    cursor = Cursor(memoryview(layout.mapped), limits.vocab_limit())
    cursor.pos = 16
    out = []
    for _ in range(cursor.scalar("<Q")):
        key = cursor.string()
        vtype = cursor.scalar("<I")
        item = int.from_bytes(layout.mapped[cursor.pos : cursor.pos + 4], "little") if vtype == _ARRAY else None
        value = cursor.value(vtype)
        if key.startswith(tuple(prefixes)):
            out.append(Entry(key, value.tolist() if isinstance(value, np.ndarray) else value, vtype, item))
    return out


def write_gguf(
    path: str | os.PathLike[str],
    *,
    arch: str,
    metadata: Iterable[Entry],
    tensors: Iterable[TensorData],
    what: str,
    error: type[OneBlockError] = CheckpointError,
) -> Path:
    """Write a sealed GGUF file atomically: a reader sees the previous file or the complete new one.

    Args:
        path: the ``.gguf`` file; its directory is created if missing.
        arch: ``general.architecture`` (written by the writer itself, first).
        metadata: the other keys, in order.
        tensors: the tensors, in order.
        what: the kind of file, for messages ("GGUF model", "GGUF LoRA adapter").
        error: the error class for an operating-system failure (a full disk, no permission).

    Returns:
        ``path``.
    """
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    target = Path(path)
    check_destination(target, what, error)
    writer = _writer(GGUFWriter)(None, arch)
    writer.add_string(DIGEST_KEY, PLACEHOLDER)
    for entry in metadata:
        item = GGUFValueType(entry.item) if entry.item is not None else None
        writer.add_key_value(entry.key, entry.value, GGUFValueType(entry.vtype), item)
    for t in tensors:
        raw = GGMLQuantizationType(t.qtype) if t.qtype is not None else None
        writer.add_tensor(t.name, t.array, raw_dtype=raw)
    tmp = target.parent / f".{secrets.token_hex(4)}.tmp"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        _seal(tmp)
        os.replace(tmp, target)
    except OSError as err:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise error(
            f"{describe_os_error(err, target, f'write the {what}')}; any previous file there is intact"
        ) from None
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(target.parent)
    return target


def _writer(base: type) -> type:
    """``gguf.GGUFWriter`` that also writes an empty array (its item type and a count of 0), as GGUF allows.

    The format stores an array as item type, count, items; llama.cpp's reader and ``gguf.GGUFReader`` read a
    count of 0, and oneblock loads such a file, but ``GGUFWriter`` refuses to pack one. The array's item type
    comes from the file it was copied from (``Entry.item``).
    """
    from gguf import GGUFValueType

    class Writer(base):
        def _pack_val(self, val: Any, vtype: Any, add_vtype: bool, sub_type: Any = None) -> bytes:
            if vtype == GGUFValueType.ARRAY and sub_type is not None and isinstance(val, Sequence) and not len(val):
                prefix = self._pack("I", vtype) if add_vtype else b""
                return prefix + self._pack("I", sub_type) + self._pack("Q", 0)
            return bytes(super()._pack_val(val, vtype, add_vtype, sub_type))

    return Writer


def _seal(path: Path) -> None:
    """Write the SHA-256 of the file (with zeros where the digest goes) over the zeros, and flush to disk."""
    with path.open("r+b") as f:
        head = f.read(DIGEST_WITHIN)
        at = head.find(PLACEHOLDER.encode())
        if at < 0:
            raise CheckpointError(f"internal: no digest placeholder in the first bytes of {str(path)!r}")
        f.seek(0)
        sha = hashlib.sha256()
        while chunk := f.read(1 << 24):
            sha.update(chunk)
        digest = sha.hexdigest()
        f.seek(at)
        f.write(digest.encode())
        f.flush()
        os.fsync(f.fileno())
