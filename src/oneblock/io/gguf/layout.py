"""Reading a GGUF file in one pass over its header, with the tensor data left memory-mapped.

A GGUF file (version 2 or 3, little-endian) is: the magic ``b"GGUF"``, a version, the tensor and metadata counts;
the metadata as typed key/value pairs; one record per tensor (name, dimensions innermost first, GGML type, offset);
padding to ``general.alignment`` (32 by default); the tensor data.

``gguf.GGUFReader`` builds a numpy view for every element of every array while opening, several seconds for a
49,152-token vocabulary and its merges. This reader walks the same bytes once with ``struct`` and hands each
tensor out as a zero-copy ``torch.uint8`` view of the mapped file: nothing is read from disk until a tensor is
decoded, and a tensor that the kernels use as stored is never copied.

The file is checked as llama.cpp's own reader (``gguf.cpp``) checks it, before anything is built from it: no key
and no tensor name twice; ``general.alignment`` a positive power of two; at most 4 dimensions, none zero, and rows
(``ne0``) of whole blocks for the block formats; each tensor's offset exactly the aligned end of the one before,
so tensors neither overlap nor alias nor start off alignment; the data inside the file. Metadata arrays nest at
most ``MAX_ARRAY_DEPTH`` deep, numeric arrays stay read-only numpy views of the file (a Python list would take
9 times the memory), and an array of strings holds at most ``oneblock.io.limits.vocab_limit()`` of them.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oneblock.errors import CheckpointError
from oneblock.io import limits
from oneblock.io.gguf.cursor import DEFERRED, Cursor, TooMany
from oneblock.io.gguf.file import check_gguf_file, checked_value
from oneblock.io.gguf.types import type_info
from oneblock.io.integrity import DIGEST_KEY, verify

_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS

DIGEST_WITHIN = 1 << 16  # oneblock writes the digest early in the metadata: within the file's first 64 KiB


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of the file.

    Attributes:
        name: its GGUF name, e.g. ``blk.0.attn_q.weight``.
        shape: the PyTorch (row-major) shape: GGUF's dimensions reversed.
        ggml_type: the ``GGMLQuantizationType`` id.
        offset: where its bytes start, from the start of the file.
        data: its bytes, a zero-copy (nbytes,) uint8 view of the mapped file; read it through ``checked_data``.
        mapped: the mapping ``data`` views, to check the file's size again before reading.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    data: torch.Tensor
    mapped: mmap.mmap | None = field(default=None, repr=False, compare=False)

    def checked_data(self) -> torch.Tensor:
        """``data``, once the file is known to still hold it.

        Reading a mapped page past the end of a file that another process truncated kills this process with
        SIGBUS, which no ``try`` catches; the size is checked again right before the bytes are decoded.

        Raises:
            CheckpointError: the file is now shorter than the tensor's end.
        """
        end = self.offset + self.data.numel()
        if self.mapped is not None and self.data.numel():
            try:
                size = self.mapped.size()
            except (OSError, ValueError):
                size = -1
            if size < end:
                raise CheckpointError(
                    f"the GGUF file changed while it was open: tensor {self.name!r} needs bytes up to {end}, "
                    f"the file now has {max(size, 0)}; was it truncated or rewritten in place?"
                )
        return self.data


@dataclass
class GGUFLayout:
    """A GGUF file's metadata (every key, as Python values) and its tensors (mapped, not read)."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorRecord]
    mapped: mmap.mmap | None = None
    identity: tuple[int, ...] = ()
    """``(device, inode, size, mtime_ns, ctime_ns)`` of the file that was mapped, from the open file itself."""
    data_start: int = 0
    """Where the tensor data starts: the bytes before it are the whole header."""

    def get(self, key: str, default: Any = None) -> Any:
        """One metadata value, or ``default`` when the key is absent."""
        return self.metadata.get(key, default)

    def copied(self, record: TensorRecord) -> TensorRecord:
        """``record`` with its bytes read from the file into memory of their own (``os.preadv``), no page of the
        mapping touched: a mapped read of a few KiB (a norm's weights, a bias) maps the pages around them too, as
        much as the page cache's folio holding them (up to 2 MiB), which stay resident while the file is mapped.
        Where the file at ``path`` is no longer the one mapped, or cannot be read, ``record`` itself."""
        if self.mapped is None or not self.identity or not record.data.numel():
            return record
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return record
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) != self.identity:
                return record
            buffer = bytearray(record.data.numel())
            if os.preadv(fd, [buffer], record.offset) != len(buffer):
                return record
        except OSError:
            return record
        finally:
            os.close(fd)
        data = torch.frombuffer(buffer, dtype=torch.uint8)  # (nbytes,), holding the buffer
        return TensorRecord(record.name, record.shape, record.ggml_type, record.offset, data)

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


def read_layout(path: str | os.PathLike[str], *, max_vocab: int | None = None) -> GGUFLayout:
    """Parse a GGUF file's header, check its layout and map its tensor data.

    Args:
        path: the ``.gguf`` file.
        max_vocab: the most strings one metadata array may hold (``oneblock.io.limits.vocab_limit``).

    Returns:
        The metadata and the tensor records; tensor bytes stay on disk until used.

    Raises:
        CheckpointError: if the path is missing, a directory, too short, not GGUF, corrupt or truncated (a record
            or a tensor running past the end of the file), laid out as llama.cpp would refuse (see the module
            docstring), or holding an array over ``max_vocab`` strings.
    """
    path = Path(path)
    size = check_gguf_file(path)
    where = repr(str(path))
    with path.open("rb") as f:
        # Copy-on-write: the views are writable for torch, and nothing is ever written back to the file.
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        st = os.fstat(f.fileno())
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    try:
        cursor = Cursor(memoryview(mapped), limits.vocab_limit(max_vocab), defer=True)
        version, metadata, raw = _read_header(cursor)
    except TooMany as error:
        raise CheckpointError(f"{where}: {error}") from None
    except (struct.error, ValueError, UnicodeDecodeError, OverflowError, MemoryError) as error:
        raise CheckpointError(f"{where} is a corrupt or truncated GGUF file: {error}") from None
    if DIGEST_KEY in metadata:  # written by oneblock: every byte is checked before any is used
        verify_digest(mapped, metadata[DIGEST_KEY], where)
    alignment = _alignment(where, metadata)
    start = -(-cursor.pos // alignment) * alignment
    tensors = {}
    expected = 0  # the running aligned size of the data section, as gguf.cpp computes it
    for name, shape, ggml_type, offset in raw:
        nbytes = _nbytes(where, name, shape, ggml_type)
        if offset != expected:
            raise CheckpointError(
                f"{where} is a corrupt GGUF file: tensor {name!r} starts at data offset {offset}, expected "
                f"{expected} (the aligned end of the tensor before it); tensors must follow each other without "
                "overlap, at multiples of the alignment"
            )
        expected += -(-nbytes // alignment) * alignment
        begin = start + offset
        if begin + nbytes > size:
            raise CheckpointError(
                f"{where} is a corrupt or truncated GGUF file: tensor {name!r} needs bytes {begin} to "
                f"{begin + nbytes}, but the file ends at {size}"
            )
        data = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=begin)
        tensors[name] = TensorRecord(name, shape, ggml_type, begin, data, mapped)
    layout = GGUFLayout(path, version, metadata, tensors, mapped, identity, start)
    # The vocabulary's strings last: what the parse keeps (the records above and the layout, a few thousand small
    # objects) then lies in memory before them, not among them, and once a tokenizer is built and the strings are
    # dropped, the arenas they filled are empty and go back to the system (made among them, the records kept 9 MiB
    # resident). The decoded values take their keys' places, so the metadata keeps the file's order.
    try:
        decoded = [(key, cursor.decode(begin, ends)) for key, begin, ends in cursor.deferred]
    except (ValueError, UnicodeDecodeError, MemoryError) as error:
        raise CheckpointError(f"{where} is a corrupt or truncated GGUF file: {error}") from None
    for key, strings in decoded:
        metadata[key] = checked_value(key, strings)
    return layout


def _read_header(cursor: Cursor) -> tuple[int, dict[str, Any], list[tuple[str, tuple[int, ...], int, int]]]:
    """The version, the metadata and the raw tensor records ``(name, shape, type, offset)``."""
    cursor.pos = 4
    version, n_tensors, n_kv = cursor.scalar("<I"), cursor.scalar("<Q"), cursor.scalar("<Q")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cursor.key = cursor.string()
        if key in metadata:
            raise ValueError(f"the metadata key {key!r} appears twice")
        value = cursor.value(cursor.scalar("<I"))
        metadata[key] = value if value is DEFERRED else checked_value(key, value)
    raw = []
    names = set()
    for _ in range(n_tensors):
        name = cursor.string()
        if name in names:
            raise ValueError(f"the tensor name {name!r} appears twice")
        names.add(name)
        n_dims = cursor.scalar("<I")
        if n_dims > _MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions; GGUF tensors have at most {_MAX_DIMS}")
        dims = [cursor.scalar("<Q") for _ in range(n_dims)]
        if 0 in dims:
            raise ValueError(f"tensor {name!r} has a zero dimension (GGUF dimensions {dims}); it holds no values")
        if int(np.prod(dims, dtype=object)) >= 2**63:
            raise ValueError(f"tensor {name!r} has dimensions {dims}, more values than a file can hold")
        raw.append((name, tuple(reversed(dims)), cursor.scalar("<I"), cursor.scalar("<Q")))
    return version, metadata, raw


def _alignment(where: str, metadata: dict[str, Any]) -> int:
    """``general.alignment``, refused unless a positive power of two (a wrong one moves every tensor's bytes)."""
    value = metadata.get("general.alignment", _ALIGNMENT)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value & (value - 1):
        shown = repr(value.tolist() if isinstance(value, np.ndarray) else value)
        raise CheckpointError(
            f"{where} is a corrupt GGUF file: general.alignment is {shown}, but it must be a positive power of "
            f"two (the default is {_ALIGNMENT})"
        )
    return value


def _nbytes(where: str, name: str, shape: tuple[int, ...], type_id: int) -> int:
    """Bytes of a tensor in the file (a type oneblock cannot decode is refused later, with the supported list).

    Raises:
        CheckpointError: a block format whose rows (``ne0``, the last PyTorch dimension) are not whole blocks,
            as llama.cpp refuses them: the bytes of a partial block do not exist in the file.
    """
    known = type_info(type_id)
    if known is None:  # its size is unknown, so is where the next tensor starts
        raise CheckpointError(
            f"{where} is a corrupt GGUF file, or newer than the gguf package: tensor {name!r} has the unknown "
            f"GGML type id {type_id}"
        )
    kind, block, type_size = known
    row = shape[-1] if shape else 1
    if row % block:
        raise CheckpointError(
            f"{where} is a corrupt GGUF file: tensor {name!r} ({kind}, shape {shape}) has rows of {row} "
            f"values, not a multiple of the {block}-value blocks of {kind}"
        )
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return n // block * type_size


def verify_digest(mapped: mmap.mmap, recorded: object, name: str) -> None:
    """Refuse a GGUF file whose recorded ``oneblock.sha256`` is not the digest of its bytes.

    Raises:
        CheckpointError: the digest differs (a byte changed after writing) or is malformed.
    """
    verify(mapped, recorded, name, 0, min(len(mapped), DIGEST_WITHIN))
