"""A run's checkpoints: one directory per saved step, complete before ``latest.json`` names it.

::

    RUN/checkpoints/step-000200/model.safetensors    oneblock.io.checkpoint.save: weights + ModelConfig
                               /trainable.safetensors  instead, for a pretrained model: only the parameters that
                                                     train (``requires_grad``), e.g. the LoRA adapters
                               /head.safetensors     the task head (classifier or masked-LM), when there is one
                               /trainer.safetensors  optimizer, schedule, data position, random generators
    RUN/checkpoints/latest.json                      {"step": 200, "dir": "step-000200", "sha256": ...}

Every file carries the digest of all its bytes (``oneblock.io.integrity``). A step is written under
``.step-000200.tmp``, each file flushed to disk, and renamed into place; only then is ``latest.json`` replaced.
Re-saving a step that exists moves the old copy to ``.step-000200.old`` first. Pruning renames a step to
``.step-000200.del`` before deleting it. So a name ``step-*`` always means a complete step, and a SIGKILL at any
instant leaves a directory that ``recover`` puts right: it finishes or removes the interrupted save, deletes
temporary files, and when ``latest.json`` is missing, damaged or names a step that does not verify, falls back to
the newest step that does.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from oneblock.errors import CheckpointError
from oneblock.io import checkpoint as checkpoint_io
from oneblock.io import files, integrity
from oneblock.train.state import load_state, save_state

MODEL_FILE = "model.safetensors"
HEAD_FILE = "head.safetensors"
TRAINABLE_FILE = "trainable.safetensors"
TRAINABLE_FORMAT = "oneblock-trainable"
TRAINER_FILE = "trainer.safetensors"
LATEST = "latest.json"
HEAD_FORMAT = "oneblock-task-head"
_STEP = re.compile(r"step-(\d{6,})")
_LEFTOVER = re.compile(r"\.(step-\d{6,})\.(tmp|old|del)")


class CheckpointDir:
    """Save, find and repair the checkpoints of one run.

    Args:
        root: the run's ``checkpoints`` directory (created on first save).
        keep: how many step directories to keep; older ones are deleted after a successful save.
        trainable_only: store only the parameters with ``requires_grad`` (a pretrained model whose frozen part is
            loaded again from its source on resume) instead of the whole model and its config.

    Attributes:
        notes: what ``recover`` found and did, one sentence each (an interrupted save finished, a fallback).
    """

    def __init__(self, root: str | Path, *, keep: int = 2, trainable_only: bool = False) -> None:
        self.root = Path(root)
        self.keep = keep
        self.trainable_only = trainable_only
        self.notes: list[str] = []

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

        Raises:
            CheckpointError: a file cannot be written (disk full, permission, ...); the previous checkpoint and
                ``latest.json`` are intact.
        """
        name = f"step-{step:06d}"
        final, tmp, old = self.root / name, self.root / f".{name}.tmp", self.root / f".{name}.old"
        with _os_errors(self.root, "save a checkpoint in"):
            _remove(tmp)
            tmp.mkdir(parents=True)
        try:
            if self.trainable_only:
                save_trainable(model, tmp / TRAINABLE_FILE)
            else:
                checkpoint_io.save(model, tmp / MODEL_FILE, metadata={"step": step, **(metadata or {})})
            if head is not None:
                save_head(head, tmp / HEAD_FILE)
            save_state(state, tmp / TRAINER_FILE)
        except BaseException:
            _remove(tmp)
            raise
        with _os_errors(self.root, "save a checkpoint in"):
            files.fsync_directory(tmp)
            if final.exists():  # the same step saved again (e.g. Ctrl-C right after a periodic save)
                _remove(old)
                os.replace(final, old)
            os.replace(tmp, final)
            files.fsync_directory(self.root)
        self._point_at(step, name)
        _remove(old)
        self._prune(keep_name=name)
        return final

    def latest(self) -> Path | None:
        """The newest complete step directory, after ``recover``; None when the run has none."""
        return self.recover()

    def recover(self) -> Path | None:
        """Put an interrupted run's directory right and return its newest step that verifies (None if none).

        Finishes a save that was interrupted after its step was complete, removes partial steps and temporary
        files, and repairs ``latest.json`` when it is missing, damaged or dangling. What was done is appended to
        ``notes``.
        """
        if not self.root.is_dir():
            return None
        with _os_errors(self.root, "repair the checkpoints in"):
            self._finish_interrupted()
            named = self._pointer()
            if named is not None and verifies(self.root / named):
                return self.root / named
            for step_dir in self.steps()[::-1]:
                if verifies(step_dir):
                    self.notes.append(f"resuming from {step_dir.name}, the newest step that verifies")
                    self._point_at(int(_STEP.fullmatch(step_dir.name).group(1)), step_dir.name)  # type: ignore[union-attr]
                    return step_dir
                self.notes.append(f"{str(step_dir)!r} is damaged; skipped")
        return None

    def steps(self) -> list[Path]:
        """The step directories, oldest first."""
        found = [p for p in self.root.glob("step-*") if _STEP.fullmatch(p.name) and p.is_dir()]
        return sorted(found, key=lambda p: int(p.name[5:]))

    def clear(self) -> None:
        """Delete the whole checkpoints directory (a run started afresh)."""
        with _os_errors(self.root, "clear"):
            _remove(self.root)

    def load(self, path: Path, model: nn.Module, *, head: nn.Module | None = None) -> dict[str, Any]:
        """Copy the weights of checkpoint ``path`` into ``model`` (and ``head``); return the trainer state."""
        if self.trainable_only:
            load_trainable(path / TRAINABLE_FILE, model)
            return load_state(path / TRAINER_FILE)
        stored = checkpoint_io.load(path / MODEL_FILE)
        if stored.config != model.config:
            raise CheckpointError(
                f"checkpoint {str(path)!r} holds a different model configuration than this run; resume with the "
                "run's own config.json"
            )
        model.load_state_dict(stored.state_dict())
        if head is not None:
            head.load_state_dict({**load_head(path / HEAD_FILE, head), **_encoder_state(head)}, strict=True)
        return load_state(path / TRAINER_FILE)

    # Repair.
    def _finish_interrupted(self) -> None:
        files.remove_leftovers(self.root)
        leftovers = []
        for entry in self.root.iterdir():
            match = _LEFTOVER.fullmatch(entry.name)
            if match and entry.is_dir():
                leftovers.append((("tmp", "old", "del").index(match.group(2)), match.group(1), entry))
        for _, name, entry in sorted(leftovers):  # a complete .tmp is newer than an .old copy of the same step
            final = self.root / name
            if not entry.name.endswith(".del") and not final.exists() and verifies(entry):
                os.replace(entry, final)
                self.notes.append(f"finished the interrupted save of {name}")
            else:
                _remove(entry)
        for step_dir in self.steps():
            files.remove_leftovers(step_dir)

    def _pointer(self) -> str | None:
        """The step ``latest.json`` names, or None (with a note) when it is missing, damaged or dangling."""
        pointer = self.root / LATEST
        if not pointer.exists():
            if self.steps():
                self.notes.append(f"{str(pointer)!r} is missing")
            return None
        try:
            data = integrity.load_json(pointer, "run pointer")
        except CheckpointError as error:
            self.notes.append(str(error))
            return None
        name = data.get("dir")
        if not isinstance(name, str) or not _STEP.fullmatch(name):
            self.notes.append(f"{str(pointer)!r} names no step")
            return None
        if not (self.root / name).is_dir():
            self.notes.append(f"{str(pointer)!r} names {name}, which does not exist")
            return None
        return name

    def _point_at(self, step: int, name: str) -> None:
        files.write_atomic(self.root / LATEST, integrity.dump_json({"step": step, "dir": name}), what="run pointer")

    def _prune(self, *, keep_name: str) -> None:
        steps = self.steps()
        for old in steps[: max(0, len(steps) - self.keep)]:
            if old.name != keep_name:
                doomed = self.root / f".{old.name}.del"  # never a half-deleted directory under a step-* name
                with contextlib.suppress(OSError):
                    os.replace(old, doomed)
                    _remove(doomed)


def verifies(step_dir: Path) -> bool:
    """Whether every file of a step directory is present and passes its digest."""
    try:
        if (step_dir / TRAINABLE_FILE).exists():
            integrity.load_sealed(step_dir / TRAINABLE_FILE, "trainable parameters")
        else:
            checkpoint_io.read_info(step_dir / MODEL_FILE)
        integrity.load_sealed(step_dir / TRAINER_FILE, "training state")
        if (step_dir / HEAD_FILE).exists():
            integrity.load_sealed(step_dir / HEAD_FILE, "task head")
    except CheckpointError:
        return False
    return True


def trainable_state(model: nn.Module) -> dict:
    """The parameters that train (``requires_grad``), by name; a shared parameter once."""
    return {k: p.detach().cpu().contiguous() for k, p in model.named_parameters() if p.requires_grad}


def save_trainable(model: nn.Module, path: Path) -> None:
    """The trainable parameters, sealed with their digest."""
    blob = integrity.dump_safetensors(trainable_state(model), {"format": TRAINABLE_FORMAT})
    files.write_atomic(path, blob, what="trainable parameters")


def load_trainable(path: Path, model: nn.Module) -> None:
    """Copy a ``save_trainable`` file into ``model``'s trainable parameters, refused unless names, shapes and
    dtypes match exactly (a checkpoint of another model, or another set of adapters)."""
    name = repr(str(path))
    entries, metadata, blob = integrity.load_sealed(path, "trainable parameters")
    if metadata.get("format") != TRAINABLE_FORMAT:
        raise CheckpointError(f"{name} is not a oneblock trainable-parameter file (format {metadata.get('format')!r})")
    params = dict(model.named_parameters())
    listing = {k: (e["dtype"], tuple(e["shape"])) for k, e in entries.items()}
    want = {k: (integrity.dtype_name(p.dtype), tuple(p.shape)) for k, p in params.items() if p.requires_grad}
    if listing != want:
        missing, extra = sorted(set(want) - set(listing)), sorted(set(listing) - set(want))
        raise CheckpointError(
            f"{name} does not match this run's trainable parameters (missing {missing[:3]}, unexpected "
            f"{extra[:3]}, or other shapes); resume with the run's own config.json"
        )
    for key, tensor in integrity.tensors_of(blob, name).items():
        params[key].data.copy_(tensor)


def head_state(head: nn.Module) -> dict:
    """The head's own tensors: the wrapper's state dict without the encoder's entries."""
    return {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items() if not k.startswith("encoder.")}


def save_head(head: nn.Module, path: Path) -> None:
    """The head's own tensors, sealed with their digest."""
    blob = integrity.dump_safetensors(head_state(head), {"format": HEAD_FORMAT})
    files.write_atomic(path, blob, what="task head")


def load_head(path: Path, head: nn.Module) -> dict:
    """The verified tensors of a ``save_head`` file, refused unless they match ``head`` in names, shapes, dtypes."""
    name = repr(str(path))
    entries, metadata, blob = integrity.load_sealed(path, "task head")
    if metadata.get("format") != HEAD_FORMAT:
        raise CheckpointError(f"{name} is not a oneblock task head (format {metadata.get('format')!r})")
    expected = head_state(head)
    listing = {k: (e["dtype"], tuple(e["shape"])) for k, e in entries.items()}
    want = {k: (integrity.dtype_name(t.dtype), tuple(t.shape)) for k, t in expected.items()}
    if listing != want:
        raise CheckpointError(f"{name} does not match this run's task head: it stores {listing}, expected {want}")
    return integrity.tensors_of(blob, name)


def _encoder_state(head: nn.Module) -> dict:
    return {k: v for k, v in head.state_dict().items() if k.startswith("encoder.")}


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextlib.contextmanager
def _os_errors(root: Path, action: str) -> Iterator[None]:
    try:
        yield
    except OSError as err:
        raise CheckpointError(files.describe_os_error(err, root, action)) from None
