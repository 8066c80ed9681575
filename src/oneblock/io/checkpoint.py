"""oneblock checkpoints: one safetensors file holding the weights, the ``ModelConfig`` and a digest of the file.

The file is plain safetensors (any safetensors reader opens it); oneblock's own facts live in its string
metadata:

- ``oneblock.format`` / ``oneblock.format_version``: what the file is, so a foreign file is refused by name;
- ``oneblock.config``: ``ModelConfig.to_json()``, enough to rebuild the model with ``build_model``;
- ``oneblock.sha256``: the SHA-256 of every byte of the file but the digest itself (``oneblock.io.integrity``), so
  a flipped bit anywhere (tensor data, config, metadata, header) is caught;
- ``oneblock.metadata``: the caller's own JSON (training step, source model, ...).

The file is mapped, not read (``oneblock.io.files.map_file``), so a checkpoint costs its model's memory once.
Loading checks, in this order and before any model is built: the header's declared sizes against the file's;
the digest; the config's size against the limits of ``oneblock.io.limits``; the tensors' names, shapes and dtypes
against a model built on the meta device (no memory); then that the values are finite. Only then is the model
allocated.

Tied and shared weights (the LM head that *is* the token embedding, the decoder's token embedding that *is*
the encoder's) are stored once, under the first name ``state_dict`` gives them; ``load`` builds the model from
its config, which ties them again by construction.

Loading never unpickles. Pickles and ``torch.save`` archives are recognised by their first bytes and refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from oneblock import jsontext
from oneblock.config import ModelConfig
from oneblock.errors import CheckpointError, ConfigError
from oneblock.io import files, integrity, limits
from oneblock.models.build import Model, build_model, build_skeleton

FORMAT = "oneblock-checkpoint"
FORMAT_VERSION = 2  # 2: the digest covers the whole file; 1 covered the tensors only
_KEY_FORMAT, _KEY_VERSION = "oneblock.format", "oneblock.format_version"
_KEY_CONFIG, _KEY_SHA, _KEY_USER = "oneblock.config", integrity.DIGEST_KEY, "oneblock.metadata"
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint's header says, read without building the model.

    Attributes:
        config: the model's configuration.
        metadata: the caller's metadata given to ``save`` (an empty dict if none).
        format_version: the checkpoint format version.
        sha256: the file's digest (of all its bytes but the digest).
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
    over ``path`` (``oneblock.io.files.write_atomic``). If anything fails on the way the temporary file is removed
    and an existing checkpoint at ``path`` is untouched.

    Args:
        model: a oneblock model (``Encoder``, ``Decoder`` or ``EncoderDecoder``) with its ``config``.
        path: the file to write; missing parent directories are created.
        metadata: JSON-serialisable facts to keep beside the weights; read them back with ``read_info``.

    Returns:
        The path written.

    Raises:
        CheckpointError: ``model`` is not a oneblock model, holds tensors other than those its config builds (an
            int8-quantized model) so that ``load`` would refuse the file, has non-finite weights, ``metadata`` is
            not JSON, the path is empty or a directory, or the file cannot be written (disk full, permission,
            read-only, a name too long), naming ``path``.
    """
    path = files.check_target(path, "checkpoint")
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig) or not isinstance(model, nn.Module):
        raise CheckpointError(f"save expects a oneblock model with a ModelConfig .config; got {type(model).__name__}")
    try:
        user = json.dumps(dict(metadata or {}), sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"save: metadata must be JSON-serialisable: {error}") from error
    tensors = unique_tensors(model.state_dict())
    _check_loadable(path, cfg, tensors, sum(p.numel() for p in model.parameters()))
    check_finite(tensors, f"refusing to save {str(path)!r}")
    header = {
        "format": "pt",
        _KEY_FORMAT: FORMAT,
        _KEY_VERSION: str(FORMAT_VERSION),
        _KEY_CONFIG: cfg.to_json(),
        _KEY_USER: user,
    }
    files.write_atomic(path, integrity.dump_safetensors(tensors, header), what="checkpoint")
    return path


def _check_loadable(path: Path, cfg: ModelConfig, tensors: Mapping[str, Tensor], held: int) -> None:
    """Refuse to write a file that ``load`` would refuse: the tensors must be those ``build_model(cfg)`` makes.

    A model changed after it was built (``quantize_int8`` swaps its Linear layers for int8 ones, ``fuse_qkv``
    merges three projections into one, a ``config`` replaced by another) no longer matches its config; saving it
    would only defer the error. ``held`` is the model's parameter count (tied ones once). The limits of
    ``oneblock.io.limits`` and the analytic parameter count are checked first, in microseconds; only a config
    that passes them is built, on the meta device.
    """
    listing = {key: (integrity.dtype_name(t.dtype), tuple(t.shape)) for key, t in tensors.items()}
    name = repr(str(path))
    try:
        stored = _stored_dtype(name, listing)
        # Before building anything (a config claiming 200,000 blocks takes minutes even on the meta device): the
        # limits load applies, and the parameters the config describes, counted analytically, against the tensors.
        counted = limits.check_model_size(cfg, what="its config", dtype=stored, error=CheckpointError)
        if counted != held:
            raise CheckpointError(
                f"its config (n_layers={cfg.n_layers}, d_model={cfg.d_model}, vocab_size={cfg.vocab_size}) "
                f"describes {counted:,} parameters, the model holds {held:,}"
            )
        skeleton = build_skeleton(cfg, dtype=stored)
        expected = skeleton.state_dict()
        aliases = _aliases(skeleton, expected)
        _check_listing(name, listing, {key: expected[key] for key in set(aliases.values())})
    except (CheckpointError, ConfigError) as error:
        raise CheckpointError(
            f"refusing to save {name}: load could not read it back ({error}). A model changed after it was built "
            "(quantize_int8, fuse_qkv) is for inference only; save the model before the change"
        ) from None


def load(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    max_parameters: int | None = None,
    max_bytes: int | None = None,
    max_layers: int | None = None,
) -> Model:
    """Read a checkpoint written by ``save`` and rebuild the model, in eval mode.

    Every check runs before the model is allocated: the file's format and digest, the config's size, that the
    tensors are exactly those the config's model has, with its shapes and dtypes, and finite.

    Args:
        path: the ``.safetensors`` file.
        dtype: cast the parameters to this dtype after loading; the stored dtype when omitted.
        device: where to put the model; the CPU when omitted.
        max_parameters, max_bytes, max_layers: the limits of ``oneblock.io.limits.check_model_size``.

    Returns:
        The model ``build_model(config)`` makes, holding the stored weights; tied weights are one Parameter.

    Raises:
        CheckpointError: naming the file and the problem (missing, empty, truncated, not safetensors, a pickle,
            digest mismatch, an implausibly large config, missing/unexpected tensors, wrong shapes or dtypes,
            NaN/inf, a config that cannot be built).
    """
    path = _source(path)
    info, blob = _read(path)
    name = repr(str(path))
    cfg = info.config
    stored = _stored_dtype(name, info.tensors)
    limits.check_model_size(
        cfg,
        what=f"checkpoint {name}",
        dtype=stored,
        max_parameters=max_parameters,
        max_bytes=max_bytes,
        max_layers=max_layers,
    )
    try:
        skeleton = build_skeleton(cfg, dtype=stored)  # names, shapes and dtypes of the model, without allocating it
    except ConfigError as error:
        raise CheckpointError(f"{name} holds a config that cannot be built: {error}") from error
    expected = skeleton.state_dict()
    aliases = _aliases(skeleton, expected)
    _check_listing(name, info.tensors, {key: expected[key] for key in set(aliases.values())})
    tensors = integrity.tensors_of(blob, name, copy=False)  # views of the mapping, copied into the model below
    check_finite(tensors, f"{name} is unusable")
    model = build_model(cfg, dtype=stored)
    # Every alias of a tied tensor gets the stored value, so load_state_dict can be strict.
    model.load_state_dict({key: tensors[aliases[key]] for key in expected}, strict=True)
    del tensors, blob
    if dtype is not None or device is not None:
        model = model.to(device=device, dtype=dtype)
    return model.eval()


def read_info(path: str | os.PathLike[str]) -> CheckpointInfo:
    """The header of a checkpoint (config, metadata, digest, tensor list), after checking the file's digest.

    Raises:
        CheckpointError: as ``load``, for every problem visible without building the model.
    """
    return _read(_source(path))[0]


def _source(path: object) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(f"a checkpoint path must be a string or a path; got {type(path).__name__}")
    if os.fspath(path) in ("", b""):
        raise CheckpointError("the checkpoint path is empty; give the .safetensors file to read")
    return Path(path)


def _read(path: Path) -> tuple[CheckpointInfo, integrity.Buffer]:
    entries, meta, blob = _load_verified(path)
    name = repr(str(path))
    try:
        cfg = ModelConfig.from_json(meta[_KEY_CONFIG])
    except ConfigError as error:
        raise CheckpointError(f"{name} holds a config that cannot be built: {error}") from error
    user = jsontext.loads(meta.get(_KEY_USER, "{}"), what=f"the metadata of {name}", error=CheckpointError)
    if not isinstance(user, dict):
        raise CheckpointError(f"{name} has metadata that is not a JSON object")
    listing = {key: (str(e["dtype"]), tuple(e["shape"])) for key, e in entries.items()}
    return CheckpointInfo(cfg, user, int(meta[_KEY_VERSION]), meta[_KEY_SHA], listing), blob


def _load_verified(path: Path) -> tuple[dict[str, Any], dict[str, str], integrity.Buffer]:
    """The verified header entries, metadata and bytes of a oneblock checkpoint."""
    name = repr(str(path))
    blob = files.map_file(path, "checkpoint")  # mapped: the header's sizes are checked before the body is read
    _, meta, _ = integrity.parse_header(blob, name)  # a pickle or a foreign file is named before the digest
    if meta.get(_KEY_FORMAT) != FORMAT:
        raise CheckpointError(
            f"{name} is a safetensors file but not a oneblock checkpoint (no {_KEY_FORMAT}={FORMAT!r} in "
            "its metadata); a Hugging Face model directory converts with `oneblock convert SRC DST`"
        )
    version = meta.get(_KEY_VERSION, "")
    if not version.isdigit() or int(version) != FORMAT_VERSION:
        raise CheckpointError(
            f"{name} has checkpoint format version {version!r}; this oneblock reads version {FORMAT_VERSION} "
            "(version 1 files, whose digest covered the tensors only, must be re-saved by the oneblock that wrote "
            "them; a newer version needs a newer oneblock)"
        )
    for key in (_KEY_CONFIG, _KEY_SHA):
        if key not in meta:
            raise CheckpointError(f"{name} lacks the {key!r} metadata entry that every checkpoint has")
    entries, meta = integrity.verify_sealed(blob, name)
    return entries, meta, blob


def _stored_dtype(name: str, listing: Mapping[str, tuple[str, tuple[int, ...]]]) -> torch.dtype:
    """The one floating dtype of the stored tensors; integer or mixed dtypes are refused, never cast."""
    kinds = sorted({dtype for dtype, _ in listing.values()})
    wrong = [f"{key} ({dtype})" for key, (dtype, _) in listing.items() if dtype not in _FLOAT_DTYPES]
    if wrong:
        raise CheckpointError(
            f"{name} stores non-floating tensors {_listing(wrong)}; a oneblock model's weights are floating point "
            "(refusing to cast them)"
        )
    if len(kinds) > 1:
        raise CheckpointError(f"{name} mixes tensor dtypes {kinds}; a checkpoint stores one dtype")
    return _TORCH_DTYPES[kinds[0]] if kinds else torch.float32


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
        int(tensor.storage_offset()),  # a plain int outside symbolic tracing
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def _aliases(model: nn.Module, state: Mapping[str, Tensor]) -> dict[str, str]:
    """State-dict key -> the key its tensor is stored under: the first key naming the same Parameter or buffer.

    Works on the meta device, where storage addresses say nothing, by the identity of the module's tensors.
    """
    owner: dict[str, int] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for key, tensor in named:
        owner[key] = id(tensor)
    first: dict[int, str] = {}
    out = {}
    for key in state:
        ident = owner.get(key, hash(key))
        out[key] = first.setdefault(ident, key)
    return out


def _check_listing(
    name: str, listing: Mapping[str, tuple[str, tuple[int, ...]]], expected: Mapping[str, Tensor]
) -> None:
    """The stored tensors must be exactly the model's, with its shapes and dtypes (nothing is cast)."""
    missing = sorted(set(expected) - set(listing))
    unexpected = sorted(set(listing) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors {_listing(unexpected)}")
        raise CheckpointError(f"{name} does not match the model its config describes: {'; '.join(parts)}")
    wrong = [
        f"{key} is {listing[key][1]}, expected {tuple(expected[key].shape)}"
        for key in sorted(expected)
        if listing[key][1] != tuple(expected[key].shape)
    ]
    if wrong:
        raise CheckpointError(f"{name} has tensors of the wrong shape: {_listing(wrong)}")
    wrong = [
        f"{key} is {listing[key][0]}, expected {integrity.dtype_name(expected[key].dtype)}"
        for key in sorted(expected)
        if listing[key][0] != integrity.dtype_name(expected[key].dtype)
    ]
    if wrong:
        raise CheckpointError(f"{name} has tensors of the wrong dtype (refusing to cast): {_listing(wrong)}")


def _listing(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
