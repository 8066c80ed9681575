"""One integrity rule for every file oneblock writes: a SHA-256 over all of its bytes but the digest itself.

The digest is stored inside the file, as a 64-character hex string (in a safetensors file's metadata, or as a
JSON value). Writing puts 64 zeros where the digest goes, hashes the whole file, and writes the digest over the
zeros; checking finds the recorded digest, puts the zeros back, hashes and compares. So a change to any byte
(header, config, metadata, tensor data, or the digest) is refused before anything is built from the file.

Safetensors files are mapped, not read (``oneblock.io.files.map_file``): the 8-byte header length and the JSON
header are checked against the file's size before any other byte is touched, the digest is computed over the
mapping, and the tensors are built from the same mapping, so the bytes verified are the bytes used (unless
another process rewrites the file in place meanwhile; oneblock itself only ever replaces files by renaming).
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import struct
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from oneblock import jsontext
from oneblock.errors import CheckpointError
from oneblock.io.files import map_file, read_bytes

PLACEHOLDER = "0" * 64
Buffer = bytes | mmap.mmap  # a file's bytes, or its mapping
DIGEST_KEY = "oneblock.sha256"
_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header
# First bytes of formats that must not be unpickled: pickle protocol 2+ starts with PROTO (0x80, version 2-5),
# torch.save (since 1.6) writes a zip archive.
_ZIP_MAGIC = b"PK\x03\x04"


def seal(blob: bytes, start: int = 0, end: int | None = None) -> list[memoryview]:
    """``blob`` with its one ``PLACEHOLDER`` in ``blob[start:end]`` replaced by the digest, as chunks to write."""
    end = len(blob) if end is None else end
    at = blob.find(PLACEHOLDER.encode(), start, end)
    if at < 0 or blob.find(PLACEHOLDER.encode(), at + 1, end) >= 0:
        raise CheckpointError("internal: a sealed file needs exactly one digest placeholder")
    view = memoryview(blob)
    digest = hashlib.sha256(view).hexdigest().encode()
    return [view[:at], memoryview(digest), view[at + len(digest) :]]


def verify(blob: Buffer, recorded: object, name: str, start: int = 0, end: int | None = None) -> None:
    """Refuse ``blob`` unless ``recorded`` is the digest of its bytes with the digest replaced by zeros.

    Args:
        blob: the file's bytes.
        recorded: the digest the file records (a 64-character lowercase hex string).
        name: the file, for the message.
        start, end: where in ``blob`` the digest is written (the header of a safetensors file).
    """
    end = len(blob) if end is None else end
    if not isinstance(recorded, str) or len(recorded) != 64 or any(c not in "0123456789abcdef" for c in recorded):
        raise CheckpointError(f"{name} is corrupt: its recorded SHA-256 {str(recorded)[:70]!r} is not a digest")
    at = blob.find(recorded.encode(), start, end)
    if at < 0 or blob.find(recorded.encode(), at + 1, end) >= 0:
        raise CheckpointError(f"{name} is corrupt: its recorded SHA-256 is not where the file keeps it")
    digest = hashlib.sha256()
    view = memoryview(blob)
    digest.update(view[:at])
    digest.update(PLACEHOLDER.encode())
    digest.update(view[at + 64 :])
    actual = digest.hexdigest()
    if actual != recorded:
        raise CheckpointError(
            f"{name} is corrupt: the SHA-256 of its bytes is {actual[:16]}..., the file records {recorded[:16]}...; "
            "it was modified or damaged after it was written"
        )


def dump_safetensors(tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> list[memoryview]:
    """A safetensors file holding ``tensors`` and ``metadata`` plus its own digest under ``DIGEST_KEY``."""
    from safetensors import SafetensorError  # imported by writers only: readers of other formats never need it
    from safetensors.torch import save as save_safetensors_bytes

    try:
        blob = save_safetensors_bytes(dict(tensors), metadata={**metadata, DIGEST_KEY: PLACEHOLDER})
    except (SafetensorError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"cannot serialise the tensors: {error}") from None
    (n,) = struct.unpack("<Q", blob[:8])
    return seal(blob, 8, 8 + n)


def load_sealed(path: Path, what: str) -> tuple[dict[str, Any], dict[str, str], Buffer]:
    """Read a file written from ``dump_safetensors`` and check its digest; nothing is built from it yet.

    Returns:
        ``(entries, metadata, blob)``: the header's tensor entries (name -> ``{"dtype", "shape",
        "data_offsets"}``), its string metadata, and the file's mapped bytes (for ``tensors_of``).

    Raises:
        CheckpointError: missing, empty, a pickle, truncated, not safetensors, no digest, or a digest mismatch.
    """
    blob = map_file(path, what)
    entries, metadata = verify_sealed(blob, repr(str(path)))
    return entries, metadata, blob


def verify_sealed(blob: Buffer, name: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The tensor entries and metadata of the safetensors bytes ``blob``, after checking its digest."""
    entries, metadata, n = parse_header(blob, name)
    if DIGEST_KEY not in metadata:
        raise CheckpointError(
            f"{name} carries no {DIGEST_KEY!r} digest; it was not written by this oneblock (or was altered)"
        )
    verify(blob, metadata[DIGEST_KEY], name, 8, 8 + n)
    return entries, metadata


def tensors_of(blob: Buffer, name: str, *, copy: bool = True) -> dict[str, Tensor]:
    """The tensors of a verified safetensors file's bytes (or mapping), in the header's order.

    Args:
        blob: the file's bytes, or its mapping from ``map_file``.
        name: the file, for messages.
        copy: return tensors of their own; ``False`` returns views of a mapping, for a caller that copies them
            at once (``load_state_dict``) and so never holds the file twice in memory.

    Raises:
        CheckpointError: a dtype oneblock does not know, or tensors that do not tile the data exactly (gaps,
            overlaps, a byte count that does not match the shape), as safetensors refuses them.
    """
    entries, _, n = parse_header(blob, name)
    out: dict[str, Tensor] = {}
    spans = []
    writable = not isinstance(blob, bytes)
    for key, entry in entries.items():
        dtype = _DTYPES_BY_NAME.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{name} stores tensor {key!r} as {entry['dtype']!r}, a dtype oneblock does not read")
        shape = tuple(entry["shape"])
        low, high = entry["data_offsets"]
        count = math.prod(shape)
        if high - low != count * dtype.itemsize:
            raise CheckpointError(
                f"{name} is not a readable safetensors file: tensor {key!r} ({entry['dtype']}, shape {shape}) "
                f"needs {count * dtype.itemsize} bytes, its offsets give {high - low}"
            )
        spans.append((low, high, key))
        with warnings.catch_warnings():  # a read-only buffer (bytes) is cloned below, never written
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(blob, dtype=torch.uint8, count=high - low, offset=8 + n + low) if count else None
        tensor = torch.empty(0, dtype=torch.uint8) if raw is None else raw
        tensor = tensor.view(dtype).reshape(shape) if count else torch.empty(shape, dtype=dtype)
        out[key] = tensor.clone() if copy or not writable else tensor
    position = 0
    for low, high, key in sorted(spans):
        if low != position:
            raise CheckpointError(
                f"{name} is not a readable safetensors file: tensor {key!r} starts at data byte {low}, expected "
                f"{position} (tensors overlap or leave a gap)"
            )
        position = high
    return out


def parse_header(blob: Buffer, name: str) -> tuple[dict[str, Any], dict[str, str], int]:
    """Check a safetensors file's layout and split its JSON header.

    Layout: 8 bytes little-endian header length N, N bytes of JSON, then the tensor data; every tensor's
    ``data_offsets`` lie inside the data, which ends exactly at the largest offset.

    Returns:
        ``(entries, metadata, N)``.
    """
    size = len(blob)
    if size == 0:
        raise CheckpointError(f"{name} is empty (0 bytes); it was never written or was truncated")
    n = struct.unpack("<Q", blob[:8])[0] if size >= 8 else 0
    looks_safetensors = size >= 9 and 8 + n <= size and blob[8:9] == b"{"
    if not looks_safetensors and (is_pickle(blob[:2]) or blob[:4] == _ZIP_MAGIC):
        kind = "a torch.save zip archive" if blob[:4] == _ZIP_MAGIC else "a pickle"
        raise CheckpointError(
            f"{name} is {kind}: refusing to unpickle (unpickling can run arbitrary code); oneblock reads "
            "safetensors files only"
        )
    if size < 8:
        raise CheckpointError(f"{name} is truncated: {size} bytes, shorter than a safetensors header")
    if n > _MAX_HEADER:
        raise CheckpointError(f"{name} is not a safetensors file: its first 8 bytes declare a {n}-byte header")
    if 8 + n > size:
        raise CheckpointError(f"{name} is truncated: its header declares {n} bytes but the file has {size} in all")
    header = jsontext.loads(blob[8 : 8 + n], what=f"the safetensors header of {name}", error=CheckpointError)
    if not isinstance(header, dict):
        raise CheckpointError(f"{name} is not a safetensors file: its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{name} is not a safetensors file: its metadata is not a map of strings")
    try:
        end = 0
        for entry in header.values():
            low, high = (int(x) for x in entry["data_offsets"])
            if not 0 <= low <= high or not isinstance(entry["dtype"], str):
                raise ValueError
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry["shape"]):
                raise ValueError
            end = max(end, high)
    except (KeyError, TypeError, IndexError, ValueError):
        raise CheckpointError(f"{name} is not a safetensors file: malformed tensor entries") from None
    data = size - 8 - n
    if data < end:
        raise CheckpointError(f"{name} is truncated: its tensors need {end} bytes of data, the file holds {data}")
    if data > end:
        raise CheckpointError(f"{name} has {data - end} unexpected bytes after its tensor data")
    return header, metadata, n


def is_pickle(head: bytes) -> bool:
    """Whether ``head`` (a file's first bytes) starts a pickle of protocol 2 or later."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def dump_json(payload: Mapping[str, Any]) -> list[memoryview]:
    """A JSON object ``payload`` plus ``"sha256"``, the digest of the file's bytes (``load_json`` checks it)."""
    if "sha256" in payload:
        raise CheckpointError("internal: 'sha256' is reserved in a sealed JSON file")
    text = json.dumps({**payload, "sha256": PLACEHOLDER}, indent=1, sort_keys=True, allow_nan=False) + "\n"
    return seal(text.encode())


def load_json(path: Path, what: str) -> dict[str, Any]:
    """The JSON object of a file written from ``dump_json``, after checking its digest (the key is dropped)."""
    blob = read_bytes(path, what, limit=jsontext.MAX_BYTES)
    name = repr(str(path))
    data = jsontext.loads(blob, what=f"the {what} {name}", error=CheckpointError)
    if not isinstance(data, dict) or "sha256" not in data:
        raise CheckpointError(f"the {what} {name} is not a JSON object with its 'sha256' digest")
    verify(blob, data.pop("sha256"), f"the {what} {name}")
    return data


def dtype_name(dtype: torch.dtype) -> str:
    """The name safetensors writes for ``dtype`` (``F32``, ``BF16``, ``I64``, ...)."""
    return _DTYPE_NAMES.get(dtype, str(dtype))


_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPES_BY_NAME = {name: dtype for dtype, name in _DTYPE_NAMES.items()}
