"""Reading a GGUF file in one pass over its header, with the tensor data left memory-mapped.

A GGUF file (version 2 or 3, little-endian) is: the magic ``b"GGUF"``, a version, the tensor and metadata counts;
the metadata as typed key/value pairs; one record per tensor (name, dimensions innermost first, GGML type, offset);
padding to ``general.alignment`` (32 by default); the tensor data.

``gguf.GGUFReader`` builds a numpy view for every element of every array while opening, several seconds for a
49,152-token vocabulary and its merges. This reader walks the same bytes once with ``struct`` and hands each
tensor out as a zero-copy ``torch.uint8`` view of the mapped file: nothing is read from disk until a tensor is
decoded, and a tensor that the kernels use as stored is never copied.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oneblock.errors import CheckpointError
from oneblock.io.gguf.file import check_gguf_file, checked_value
from oneblock.io.gguf.writer import verify_digest
from oneblock.io.integrity import DIGEST_KEY

_ALIGNMENT = 32

# GGUF value type id -> (struct format, numpy dtype) of the scalar types.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "<u1"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of the file.

    Attributes:
        name: its GGUF name, e.g. ``blk.0.attn_q.weight``.
        shape: the PyTorch (row-major) shape: GGUF's dimensions reversed.
        ggml_type: the ``GGMLQuantizationType`` id.
        offset: where its bytes start, from the start of the file.
        data: its bytes, a zero-copy (nbytes,) uint8 view of the mapped file.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    data: torch.Tensor


@dataclass
class GGUFLayout:
    """A GGUF file's metadata (every key, as Python values) and its tensors (mapped, not read)."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorRecord]
    mapped: mmap.mmap | None = None

    def get(self, key: str, default: Any = None) -> Any:
        """One metadata value, or ``default`` when the key is absent."""
        return self.metadata.get(key, default)

    def release(self, record: TensorRecord) -> None:
        """Let the operating system drop the pages of a tensor that has been converted (they stay readable: a
        later read fetches them from the file again), so that the file does not count twice in the memory of a
        process that has copied it into a model."""
        if self.mapped is None or not hasattr(mmap, "MADV_DONTNEED") or not record.data.numel():
            return
        page = mmap.PAGESIZE
        start = -(-record.offset // page) * page  # whole pages inside the tensor only: neighbours stay
        end = (record.offset + record.data.numel()) // page * page
        if end > start:
            self.mapped.madvise(mmap.MADV_DONTNEED, start, end - start)


class _Cursor:
    """Sequential little-endian reads from a buffer."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer, self.pos = buffer, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        end = self.pos + n
        if end > len(self.buffer):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        text = str(self.buffer[self.pos : end], "utf-8")
        self.pos = end
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item in _SCALARS:  # numbers: one numpy read instead of one struct call each
                dtype = np.dtype(_SCALARS[item][1])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buffer):
                    raise ValueError(f"an array of {count} values runs past the end of the file")
                values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.pos).tolist()
                self.pos = end
                return [bool(v) for v in values] if item == _BOOL else values
            return [self.value(item) for _ in range(count)]  # arrays of arrays: rare and short
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.scalar(_SCALARS[kind][0])


def read_layout(path: str | os.PathLike[str]) -> GGUFLayout:
    """Parse a GGUF file's header and map its tensor data.

    Args:
        path: the ``.gguf`` file.

    Returns:
        The metadata and the tensor records; tensor bytes stay on disk until used.

    Raises:
        CheckpointError: if the path is missing, a directory, too short, not GGUF, or corrupt or truncated
            (a record or a tensor running past the end of the file).
    """
    path = Path(path)
    size = check_gguf_file(path)
    with path.open("rb") as f:
        # Copy-on-write: the views are writable for torch, and nothing is ever written back to the file.
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    buffer = memoryview(mapped)
    try:
        cursor = _Cursor(buffer)
        cursor.pos = 4
        version, n_tensors, n_kv = cursor.scalar("<I"), cursor.scalar("<Q"), cursor.scalar("<Q")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cursor.string()
            metadata[key] = checked_value(key, cursor.value(cursor.scalar("<I")))
        raw = []
        for _ in range(n_tensors):
            name = cursor.string()
            dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]
            raw.append((name, tuple(reversed(dims)), cursor.scalar("<I"), cursor.scalar("<Q")))
    except (struct.error, ValueError, UnicodeDecodeError, OverflowError, MemoryError) as error:
        raise CheckpointError(f"{str(path)!r} is a corrupt or truncated GGUF file: {error}") from error
    if DIGEST_KEY in metadata:  # written by oneblock: every byte is checked before any is used
        verify_digest(mapped, metadata[DIGEST_KEY], repr(str(path)))
    alignment = int(metadata.get("general.alignment", _ALIGNMENT))
    start = -(-cursor.pos // alignment) * alignment
    tensors = {}
    for name, shape, ggml_type, offset in raw:
        nbytes = _nbytes(name, shape, ggml_type)
        begin = start + offset
        if begin + nbytes > size:
            raise CheckpointError(
                f"{str(path)!r} is a corrupt or truncated GGUF file: tensor {name!r} needs bytes {begin} to "
                f"{begin + nbytes}, but the file ends at {size}"
            )
        data = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=begin) if nbytes else torch.empty(0)
        tensors[name] = TensorRecord(name, shape, ggml_type, begin, data)
    return GGUFLayout(path=path, version=version, metadata=metadata, tensors=tensors, mapped=mapped)


def _nbytes(name: str, shape: tuple[int, ...], ggml_type: int) -> int:
    """Bytes of a tensor in the file; an unknown type is refused later, by name, with the supported list."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return 0
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return n // block * type_size
