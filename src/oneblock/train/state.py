"""Resume state (optimizer, schedule, data position, random generators) stored as safetensors, never pickle.

A nested state (dicts, lists, tuples, numbers, strings, tensors; e.g. ``optimizer.state_dict()``) is split in
two: every tensor goes into the safetensors file under its path (``optimizer/state/3/exp_avg``), and the rest,
with a placeholder where each tensor was, goes into the file's metadata as JSON. Loading puts them back
together, restoring integer dict keys and tuples, so ``optimizer.load_state_dict`` gets exactly what it gave.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from oneblock import jsontext
from oneblock.errors import CheckpointError
from oneblock.io import files, integrity

FORMAT = "oneblock-train-state"
VERSION = 2  # 2: sealed with the digest of the whole file


def _encode(obj: Any, path: str, tensors: dict[str, Tensor]) -> Any:
    if isinstance(obj, Tensor):
        tensors[path] = obj.detach().cpu().contiguous().clone()  # a private copy: no shared storage
        return {"__tensor__": path}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {"__dict__": {k: _encode(v, f"{path}/{k}", tensors) for k, v in obj.items()}}
        return {"__items__": [[k, _encode(v, f"{path}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(f"cannot store a {type(obj).__name__} at {path!r} in a training state")


def _decode(obj: Any, tensors: dict[str, Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__dict__" in obj:
        return {k: _decode(v, tensors) for k, v in obj["__dict__"].items()}
    if "__items__" in obj:
        return {k: _decode(v, tensors) for k, v in obj["__items__"]}
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    raise CheckpointError(f"unrecognised entry in a training state: {sorted(obj)}")


def save_state(state: dict[str, Any], path: str | Path) -> None:
    """Write ``state`` to ``path`` atomically, sealed with the digest of all its bytes (``oneblock.io.integrity``).

    Raises:
        CheckpointError: the state holds something other than tensors, numbers, strings and containers, or the
            file cannot be written (naming ``path``).
    """
    path = files.check_target(path, "training state")
    tensors: dict[str, Tensor] = {}
    skeleton = _encode(state, "", tensors)
    try:
        text = json.dumps(skeleton, allow_nan=False)
    except ValueError as error:
        raise CheckpointError(f"cannot store a training state holding NaN or infinity: {error}") from None
    metadata = {"format": FORMAT, "version": str(VERSION), "state": text}
    files.write_atomic(path, integrity.dump_safetensors(tensors, metadata), what="training state")


def load_state(path: str | Path) -> dict[str, Any]:
    """Read a state written by ``save_state``, after checking the digest of every byte of the file.

    Raises:
        CheckpointError: the file is missing, not safetensors, damaged, or not a oneblock training state.
    """
    path = Path(path)
    name = repr(str(path))
    blob = files.map_file(path, "training state")
    _, metadata, _ = integrity.parse_header(blob, f"training state {name}")
    if metadata.get("format") != FORMAT:
        raise CheckpointError(
            f"{name} is not a oneblock training state (format {metadata.get('format')!r}, expected {FORMAT!r})"
        )
    if metadata.get("version") != str(VERSION):
        raise CheckpointError(f"training state version {metadata.get('version')!r} is not supported ({VERSION})")
    integrity.verify_sealed(blob, f"training state {name}")
    tensors = integrity.tensors_of(blob, f"training state {name}")
    try:
        return _decode(jsontext.loads(metadata["state"], what=f"training state {name}", error=CheckpointError), tensors)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(f"training state {name} is malformed: {error!r}") from None


def rng_state() -> dict[str, Any]:
    """The global random generators that training consumes (dropout): CPU, and every CUDA device if present."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` captured."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
