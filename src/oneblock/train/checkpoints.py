"""A run's checkpoints: one directory per saved step, written atomically, the newest named in ``latest.json``.

::

    RUN/checkpoints/step-000200/model.safetensors    oneblock.io.checkpoint.save: weights + ModelConfig
                               /head.safetensors     the task head (classifier or masked-LM), when there is one
                               /trainer.safetensors  optimizer, schedule, data position, random generators
    RUN/checkpoints/latest.json                      {"step": 200, "dir": "step-000200"}

A step directory is assembled under a temporary name and renamed into place, and ``latest.json`` is replaced
only after that, so an interruption at any moment leaves the previous checkpoint intact and findable.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file
from torch import nn

from oneblock.errors import CheckpointError
from oneblock.io import checkpoint as checkpoint_io
from oneblock.train.state import load_state, save_state

MODEL_FILE = "model.safetensors"
HEAD_FILE = "head.safetensors"
TRAINER_FILE = "trainer.safetensors"
LATEST = "latest.json"


class CheckpointDir:
    """Save and find the checkpoints of one run.

    Args:
        root: the run's ``checkpoints`` directory (created on first save).
        keep: how many step directories to keep; older ones are deleted after a successful save.
    """

    def __init__(self, root: str | Path, *, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = keep

    def save(
        self,
        step: int,
        model: nn.Module,
        state: dict[str, Any],
        *,
        head: nn.Module | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Path:
        """Write the checkpoint of ``step`` and point ``latest.json`` at it.

        Args:
            step: number of optimizer steps taken.
            model: the oneblock model (``Encoder``, ``Decoder`` or ``EncoderDecoder``).
            state: the trainer's resume state (see ``oneblock.train.state``).
            head: the module around ``model`` whose own parameters (all but ``encoder.*``) form the head.
            metadata: JSON facts stored in the model file (step, task, ...).

        Returns:
            The step directory.
        """
        name = f"step-{step:06d}"
        final = self.root / name
        tmp = self.root / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        checkpoint_io.save(model, tmp / MODEL_FILE, metadata={"step": step, **(metadata or {})})
        if head is not None:
            save_file(head_state(head), str(tmp / HEAD_FILE))
        save_state(state, tmp / TRAINER_FILE)
        if final.exists():  # the same step saved again (e.g. Ctrl-C right after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest_tmp = self.root / f".{LATEST}.tmp"
        latest_tmp.write_text(json.dumps({"step": step, "dir": name}))
        os.replace(latest_tmp, self.root / LATEST)
        self._prune(keep_name=name)
        return final

    def latest(self) -> Path | None:
        """The newest complete step directory, or None when the run has none."""
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        try:
            name = json.loads(pointer.read_text())["dir"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise CheckpointError(f"{str(pointer)!r} is damaged ({error}); delete it to start over") from None
        path = self.root / name
        if not path.is_dir():
            raise CheckpointError(f"{str(pointer)!r} names {name!r}, which does not exist in {str(self.root)!r}")
        return path

    def load(self, path: Path, model: nn.Module, *, head: nn.Module | None = None) -> dict[str, Any]:
        """Copy the weights of checkpoint ``path`` into ``model`` (and ``head``); return the trainer state."""
        stored = checkpoint_io.load(path / MODEL_FILE)
        if stored.config != model.config:
            raise CheckpointError(
                f"checkpoint {str(path)!r} holds a different model configuration than this run; resume with the "
                "run's own config.json"
            )
        model.load_state_dict(stored.state_dict())
        if head is not None:
            tensors = load_file(str(path / HEAD_FILE))
            head.load_state_dict({**tensors, **_encoder_state(head)}, strict=True)
        return load_state(path / TRAINER_FILE)

    def _prune(self, *, keep_name: str) -> None:
        steps = sorted(p for p in self.root.glob("step-*") if p.is_dir())
        for old in steps[: max(0, len(steps) - self.keep)]:
            if old.name != keep_name:
                shutil.rmtree(old, ignore_errors=True)


def head_state(head: nn.Module) -> dict:
    """The head's own tensors: the wrapper's state dict without the encoder's entries."""
    return {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items() if not k.startswith("encoder.")}


def _encoder_state(head: nn.Module) -> dict:
    return {k: v for k, v in head.state_dict().items() if k.startswith("encoder.")}
