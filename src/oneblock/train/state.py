"""Resume state (optimizer, schedule, data position, random generators) stored as safetensors, never pickle.

A nested state (dicts, lists, tuples, numbers, strings, tensors; e.g. ``optimizer.state_dict()``) is split in
two: every tensor goes into the safetensors file under its path (``optimizer/state/3/exp_avg``), and the rest,
with a placeholder where each tensor was, goes into the file's metadata as JSON. Loading puts them back
together, restoring integer dict keys and tuples, so ``optimizer.load_state_dict`` gets exactly what it gave.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from oneblock.errors import CheckpointError

FORMAT = "oneblock-train-state"
VERSION = 1


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
    """Write ``state`` to ``path`` atomically (a temporary file, then a rename).

    Raises:
        CheckpointError: the state holds something other than tensors, numbers, strings and containers.
    """
    path = Path(path)
    tensors: dict[str, Tensor] = {}
    skeleton = _encode(state, "", tensors)
    metadata = {"format": FORMAT, "version": str(VERSION), "state": json.dumps(skeleton)}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def load_state(path: str | Path) -> dict[str, Any]:
    """Read a state written by ``save_state``.

    Raises:
        CheckpointError: the file is missing, not safetensors, or not a oneblock training state.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"training state {str(path)!r} does not exist")
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"training state {str(path)!r} is not a readable safetensors file: {error}") from None
    if metadata.get("format") != FORMAT:
        raise CheckpointError(
            f"{str(path)!r} is not a oneblock training state (format {metadata.get('format')!r}, "
            f"expected {FORMAT!r})"
        )
    if metadata.get("version") != str(VERSION):
        raise CheckpointError(f"training state version {metadata.get('version')!r} is not supported ({VERSION})")
    return _decode(json.loads(metadata["state"]), tensors)


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
