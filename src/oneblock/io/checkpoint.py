"""oneblock checkpoints: one safetensors file holding the weights, the ``ModelConfig`` and a checksum.

The file is plain safetensors (any safetensors reader opens it); oneblock's own facts live in its string
metadata:

- ``oneblock.format`` / ``oneblock.format_version``: what the file is, so a foreign file is refused by name;
- ``oneblock.config``: ``ModelConfig.to_json()``, enough to rebuild the model with ``build_model``;
- ``oneblock.sha256``: a digest of every tensor's name, dtype, shape and bytes, so a flipped bit is caught;
- ``oneblock.metadata``: the caller's own JSON (training step, source model, ...).

Tied and shared weights (the LM head that *is* the token embedding, the decoder's token embedding that *is*
the encoder's) are stored once, under the first name ``state_dict`` gives them; ``load`` builds the model from
its config, which ties them again by construction.

Loading never unpickles. Pickles and ``torch.save`` archives are recognised by their first bytes and refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from oneblock.config import ModelConfig
from oneblock.errors import CheckpointError, ConfigError
from oneblock.models.build import build_model

FORMAT = "oneblock-checkpoint"
FORMAT_VERSION = 1
_KEY_FORMAT, _KEY_VERSION = "oneblock.format", "oneblock.format_version"
_KEY_CONFIG, _KEY_SHA, _KEY_USER = "oneblock.config", "oneblock.sha256", "oneblock.metadata"

# First bytes of formats that must not be unpickled: pickle protocol 2+ starts with PROTO (0x80, version 2-5),
# torch.save (since 1.6) writes a zip archive. A safetensors header length can begin with the same bytes, so
# a file whose first bytes also read as a plausible safetensors header is taken for one.
_ZIP_MAGIC = b"PK\x03\x04"
_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint's header says, read without loading the tensors.

    Attributes:
        config: the model's configuration.
        metadata: the caller's metadata given to ``save`` (an empty dict if none).
        format_version: the checkpoint format version.
        sha256: the stored digest of the tensors.
        tensors: name -> (dtype name as safetensors writes it, shape), for the tensors stored.
    """

    config: ModelConfig
    metadata: dict[str, Any]
    format_version: int
    sha256: str
    tensors: dict[str, tuple[str, tuple[int, ...]]]


def save(model: nn.Module, path: str | os.PathLike[str], *, metadata: Mapping[str, Any] | None = None) -> Path:
    """Write ``model`` to ``path`` atomically: a reader sees the old file or the complete new one, never half.

    The data goes to a temporary file in the same directory, is flushed to disk (``fsync``) and then renamed
    over ``path`` (``os.replace``, atomic on POSIX and Windows). If anything fails on the way the temporary
    file is removed and an existing checkpoint at ``path`` is untouched.

    Args:
        model: a oneblock model (``Encoder``, ``Decoder`` or ``EncoderDecoder``) with its ``config``.
        path: the file to write; missing parent directories are created.
        metadata: JSON-serialisable facts to keep beside the weights; read them back with ``read_info``.

    Returns:
        The path written.

    Raises:
        CheckpointError: ``model`` is not a oneblock model, has non-finite weights, or ``metadata`` is not JSON.
    """
    path = Path(path)
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig) or not isinstance(model, nn.Module):
        raise CheckpointError(f"save expects a oneblock model with a ModelConfig .config; got {type(model).__name__}")
    try:
        user = json.dumps(dict(metadata or {}), sort_keys=True)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"save: metadata must be JSON-serialisable: {error}") from error
    tensors = unique_tensors(model.state_dict())
    check_finite(tensors, f"refusing to save {str(path)!r}")
    header = {
        "format": "pt",
        _KEY_FORMAT: FORMAT,
        _KEY_VERSION: str(FORMAT_VERSION),
        _KEY_CONFIG: cfg.to_json(),
        _KEY_SHA: tensor_digest(tensors),
        _KEY_USER: user,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(tensors, header, path)
    return path


def load(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Read a checkpoint written by ``save`` and rebuild the model, in eval mode.

    Every check runs before the model sees a tensor: the file's format, its checksum, that the tensors are
    exactly those the config's model has, with the right shapes, and finite.

    Args:
        path: the ``.safetensors`` file.
        dtype: cast the parameters to this dtype; the stored dtype when omitted.
        device: where to put the model; the CPU when omitted.

    Returns:
        The model ``build_model(config)`` makes, holding the stored weights; tied weights are one Parameter.

    Raises:
        CheckpointError: naming the file and the problem (missing, empty, truncated, not safetensors, a pickle,
            checksum mismatch, missing/unexpected tensors, wrong shapes, NaN/inf, a config that cannot be built).
    """
    path = Path(path)
    info = read_info(path)
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, RuntimeError) as error:
        raise CheckpointError(f"{str(path)!r} is not a readable safetensors file: {error}") from error
    actual = tensor_digest(tensors)
    if actual != info.sha256:
        raise CheckpointError(
            f"{str(path)!r} is corrupt: the SHA-256 of its tensors is {actual[:16]}..., the file records "
            f"{info.sha256[:16]}...; the file was modified or damaged after it was written"
        )
    cfg = info.config
    stored = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
    try:
        model = build_model(cfg, dtype=stored)
    except ConfigError as error:
        raise CheckpointError(f"{str(path)!r} holds a config that cannot be built: {error}") from error
    expected = model.state_dict()
    canonical = unique_tensors(expected)
    _check_names_and_shapes(path, tensors, canonical)
    check_finite(tensors, f"{str(path)!r} is unusable")
    # Give every alias of a tied tensor the stored value, so load_state_dict can be strict.
    aliases = {key: _canonical_key(key, expected, canonical) for key in expected}
    model.load_state_dict({key: tensors[aliases[key]] for key in expected}, strict=True)
    if dtype is not None or device is not None:
        model = model.to(device=device, dtype=dtype)
    return model.eval()


def read_info(path: str | os.PathLike[str]) -> CheckpointInfo:
    """The header of a checkpoint (config, metadata, checksum, tensor list) without reading the tensors.

    Raises:
        CheckpointError: as ``load``, for every problem visible in the header.
    """
    path = Path(path)
    header = _read_header(path)
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or meta.get(_KEY_FORMAT) != FORMAT:
        raise CheckpointError(
            f"{str(path)!r} is a safetensors file but not a oneblock checkpoint (no {_KEY_FORMAT}={FORMAT!r} in "
            "its metadata); a Hugging Face model directory converts with `oneblock convert SRC DST`"
        )
    version = str(meta.get(_KEY_VERSION, ""))
    if not version.isdigit() or int(version) > FORMAT_VERSION:
        raise CheckpointError(
            f"{str(path)!r} has checkpoint format version {version!r}; this oneblock reads versions up to "
            f"{FORMAT_VERSION}. Upgrade oneblock to read it"
        )
    for key in (_KEY_CONFIG, _KEY_SHA):
        if key not in meta:
            raise CheckpointError(f"{str(path)!r} lacks the {key!r} metadata entry that every checkpoint has")
    try:
        cfg = ModelConfig.from_json(meta[_KEY_CONFIG])
    except ConfigError as error:
        raise CheckpointError(f"{str(path)!r} holds a config that cannot be built: {error}") from error
    try:
        user = json.loads(meta.get(_KEY_USER, "{}"))
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{str(path)!r} has metadata that is not valid JSON: {error}") from error
    try:
        listing = {name: (str(entry["dtype"]), tuple(entry["shape"])) for name, entry in header.items()}
    except (KeyError, TypeError):
        raise CheckpointError(f"{str(path)!r} is not a safetensors file: malformed tensor entries") from None
    return CheckpointInfo(cfg, user, int(version), meta[_KEY_SHA], listing)


def unique_tensors(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The state dict with every tied/shared tensor kept once, under the first name it appears with."""
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]] = set()
    out = {}
    for key, tensor in state.items():
        identity = _identity(tensor)
        if identity not in seen:
            seen.add(identity)
            out[key] = tensor.detach().to("cpu").contiguous()
    return out


def tensor_digest(tensors: Mapping[str, Tensor]) -> str:
    """SHA-256 (hex) over the tensors in sorted-name order: each one's name, dtype, shape and raw bytes."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def check_finite(tensors: Mapping[str, Tensor], context: str) -> None:
    """Raise ``CheckpointError`` naming the first tensors that hold NaN or infinity."""
    bad = []
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            n_nan = int(torch.isnan(tensor).sum())
            n_inf = int(torch.isinf(tensor).sum())
            bad.append(f"{name} ({n_nan} NaN, {n_inf} inf)")
    if bad:
        raise CheckpointError(f"{context}: non-finite weights in {', '.join(bad[:5])}")


def _identity(tensor: Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]:
    """Two state-dict entries are one tensor when they view the same memory the same way."""
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def _canonical_key(key: str, state: Mapping[str, Tensor], canonical: Mapping[str, Tensor]) -> str:
    """The name under which the tensor ``state[key]`` is stored."""
    if key in canonical:
        return key
    identity = _identity(state[key])
    return next(k for k in canonical if _identity(state[k]) == identity)


def _check_names_and_shapes(path: Path, tensors: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> None:
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors {_listing(unexpected)}")
        raise CheckpointError(f"{str(path)!r} does not match the model its config describes: {'; '.join(parts)}")
    wrong = [
        f"{name} is {tuple(tensors[name].shape)}, expected {tuple(expected[name].shape)}"
        for name in expected
        if tensors[name].shape != expected[name].shape
    ]
    if wrong:
        raise CheckpointError(f"{str(path)!r} has tensors of the wrong shape: {_listing(wrong)}")


def _listing(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _read_header(path: Path) -> dict[str, Any]:
    """The safetensors JSON header, after checking that the file is whole and is not a pickle.

    Layout: 8 bytes little-endian header length N, N bytes of JSON, then the tensor data; every tensor's
    ``data_offsets`` lie inside the data, which ends exactly at the largest offset.
    """
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {str(path)!r}: the file does not exist")
    if not path.is_file():
        raise CheckpointError(f"{str(path)!r} is not a file; a checkpoint is one .safetensors file")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{str(path)!r} is empty (0 bytes); it was never written or was truncated")
    with path.open("rb") as f:
        head = f.read(9)
        n = struct.unpack("<Q", head[:8])[0] if len(head) >= 8 else 0
        looks_safetensors = len(head) == 9 and 8 + n <= size and head[8:9] == b"{"
        if not looks_safetensors and _is_pickle(head):
            kind = "a torch.save zip archive" if head.startswith(_ZIP_MAGIC) else "a pickle"
            raise CheckpointError(
                f"{str(path)!r} is {kind}: refusing to unpickle; oneblock checkpoints are safetensors "
                "(unpickling can run arbitrary code). Re-save the model with oneblock.io.checkpoint.save"
            )
        if len(head) < 8:
            raise CheckpointError(f"{str(path)!r} is truncated: {size} bytes, shorter than a safetensors header")
        if n > _MAX_HEADER:
            raise CheckpointError(
                f"{str(path)!r} is not a safetensors file: its first 8 bytes declare a {n}-byte header"
            )
        if 8 + n > size:
            raise CheckpointError(
                f"{str(path)!r} is truncated: its header declares {n} bytes but the file has {size} bytes in all"
            )
        f.seek(8)
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{str(path)!r} is not a safetensors file: its header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{str(path)!r} is not a safetensors file: its header is not a JSON object")
    try:
        end = max((int(e["data_offsets"][1]) for k, e in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, IndexError, ValueError):
        raise CheckpointError(f"{str(path)!r} is not a safetensors file: malformed tensor entries") from None
    data = size - 8 - n
    if data < end:
        raise CheckpointError(
            f"{str(path)!r} is truncated: its tensors need {end} bytes of data, the file holds {data}"
        )
    if data > end:
        raise CheckpointError(f"{str(path)!r} has {data - end} unexpected bytes after its tensor data")
    return header


def _is_pickle(head: bytes) -> bool:
    return head.startswith(_ZIP_MAGIC) or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


def _atomic_write(tensors: dict[str, Tensor], header: dict[str, str], path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    # O_EXCL: never reuse another writer's file; mode 0o666 lets the umask decide, as for a plain open().
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    try:
        save_file(tensors, str(tmp), metadata=header)
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable; not possible (nor needed) on every platform."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
