"""One integrity rule for every file oneblock writes: a SHA-256 over all of its bytes but the digest itself.

The digest is stored inside the file, as a 64-character hex string (in a safetensors file's metadata, or as a
JSON value). Writing puts 64 zeros where the digest goes, hashes the whole file, and writes the digest over the
zeros; checking finds the recorded digest, puts the zeros back, hashes and compares. So a change to any byte
(header, config, metadata, tensor data, or the digest) is refused before anything is built from the file.

Safetensors files are read from memory after the check, so the bytes verified are the bytes used.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_safetensors_bytes
from torch import Tensor

from oneblock.errors import CheckpointError
from oneblock.io import jsontext
from oneblock.io.files import read_bytes

PLACEHOLDER = "0" * 64
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


def verify(blob: bytes, recorded: object, name: str, start: int = 0, end: int | None = None) -> None:
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
    try:
        blob = save_safetensors_bytes(dict(tensors), metadata={**metadata, DIGEST_KEY: PLACEHOLDER})
    except (SafetensorError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"cannot serialise the tensors: {error}") from None
    (n,) = struct.unpack("<Q", blob[:8])
    return seal(blob, 8, 8 + n)


def load_sealed(path: Path, what: str) -> tuple[dict[str, Any], dict[str, str], bytes]:
    """Read a file written from ``dump_safetensors`` and check its digest; nothing is built from it yet.

    Returns:
        ``(entries, metadata, blob)``: the header's tensor entries (name -> ``{"dtype", "shape",
        "data_offsets"}``), its string metadata, and the file's bytes (for ``tensors_of``).

    Raises:
        CheckpointError: missing, empty, a pickle, truncated, not safetensors, no digest, or a digest mismatch.
    """
    blob = read_bytes(path, what)
    entries, metadata = verify_sealed(blob, repr(str(path)))
    return entries, metadata, blob


def verify_sealed(blob: bytes, name: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The tensor entries and metadata of the safetensors bytes ``blob``, after checking its digest."""
    entries, metadata, n = parse_header(blob, name)
    if DIGEST_KEY not in metadata:
        raise CheckpointError(
            f"{name} carries no {DIGEST_KEY!r} digest; it was not written by this oneblock (or was altered)"
        )
    verify(blob, metadata[DIGEST_KEY], name, 8, 8 + n)
    return entries, metadata


def tensors_of(blob: bytes, name: str) -> dict[str, Tensor]:
    """The tensors of a verified safetensors file's bytes."""
    try:
        return load_safetensors_bytes(blob)
    except (SafetensorError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{name} is not a readable safetensors file: {error}") from None


def parse_header(blob: bytes, name: str) -> tuple[dict[str, Any], dict[str, str], int]:
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
    if not looks_safetensors and (is_pickle(blob[:2]) or blob.startswith(_ZIP_MAGIC)):
        kind = "a torch.save zip archive" if blob.startswith(_ZIP_MAGIC) else "a pickle"
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
    blob = read_bytes(path, what)
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
