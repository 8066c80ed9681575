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

A complete step that fails to verify is never deleted: ``recover`` moves it aside to ``damaged/step-000200`` (a
free name: ``step-000200-2`` when that one is taken) and says so. Only what a write never finished (``.tmp``)
and what pruning had begun to delete (``.del``) are removed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable, Iterator
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
DAMAGED = "damaged"
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
                problem = check(step_dir)
                if problem is None:
                    self.notes.append(f"resuming from {step_dir.name}, the newest step that verifies")
                    self._point_at(int(_STEP.fullmatch(step_dir.name).group(1)), step_dir.name)  # type: ignore[union-attr]
                    return step_dir
                self._move_aside(step_dir, step_dir.name, problem)
        return None

    def damaged_steps(self) -> list[Path]:
        """The steps moved aside to ``damaged/`` (by this call of ``recover`` or an earlier one), oldest first."""
        where = self.root / DAMAGED
        found = [p for p in where.glob("step-*") if p.is_dir()] if where.is_dir() else []
        return sorted(found, key=lambda p: tuple(int(n) for n in re.findall(r"\d+", p.name)))

    def newest_weights(self, *, head: bool) -> tuple[Path, int] | None:
        """The newest damaged step whose weights (and head, when ``head``) verify, with its step; None if none."""
        for step_dir in self.damaged_steps()[::-1]:
            if (head and not (step_dir / HEAD_FILE).exists()) or first_failure(step_dir, weights_only=True):
                continue
            step = checkpoint_io.read_info(step_dir / MODEL_FILE).metadata.get("step")
            if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
                return step_dir, step
        return None

    def describe_damaged(self, *, weights_only: bool = False) -> str:
        """The files that fail their check in the damaged steps, newest first, in one line."""
        failures = [first_failure(d, weights_only=weights_only) for d in self.damaged_steps()[::-1]]
        named = [repr(str(f[0])) for f in failures if f is not None]
        return ", ".join(named[:5]) + (f" and {len(named) - 5} more" if len(named) > 5 else "")

    def steps(self) -> list[Path]:
        """The step directories, oldest first."""
        found = [p for p in self.root.glob("step-*") if _STEP.fullmatch(p.name) and p.is_dir()]
        return sorted(found, key=lambda p: int(p.name[5:]))

    def clear(self) -> None:
        """Delete what the checkpoints directory holds but ``damaged/`` (a run started afresh)."""
        if not self.root.is_dir():
            return
        with _os_errors(self.root, "clear"):
            for entry in self.root.iterdir():
                if entry.name != DAMAGED:
                    _remove(entry)

    def load(self, path: Path, model: nn.Module, *, head: nn.Module | None = None) -> dict[str, Any]:
        """Copy the weights of checkpoint ``path`` into ``model`` (and ``head``); return the trainer state."""
        if self.trainable_only:
            load_trainable(path / TRAINABLE_FILE, model)
            return load_state(path / TRAINER_FILE)
        self.load_weights(path, model, head=head)
        return load_state(path / TRAINER_FILE)

    def load_weights(self, path: Path, model: nn.Module, *, head: nn.Module | None = None) -> None:
        """Copy the weights of step directory ``path`` into ``model`` (and ``head``); its trainer state is not read."""
        stored = checkpoint_io.load(path / MODEL_FILE)
        if stored.config != model.config:
            raise CheckpointError(
                f"checkpoint {str(path)!r} holds a different model configuration than this run; resume with the "
                "run's own config.json"
            )
        model.load_state_dict(stored.state_dict())
        if head is not None:
            head.load_state_dict({**load_head(path / HEAD_FILE, head), **_encoder_state(head)}, strict=True)

    # Repair.
    def _move_aside(self, step_dir: Path, name: str, problem: str) -> None:
        """Keep a complete step that fails to verify under ``damaged/``, never under a ``step-*`` name of the run."""
        where = self.root / DAMAGED
        where.mkdir(exist_ok=True)
        target, n = where / name, 1
        while target.exists():
            n += 1
            target = where / f"{name}-{n}"
        try:
            os.replace(step_dir, target)
        except FileNotFoundError:  # another rank of a distributed run moved it first
            return
        pointer = self.root / LATEST
        with contextlib.suppress(CheckpointError):  # a pointer to the step moved away points nowhere: drop it
            if integrity.load_json(pointer, "run pointer").get("dir") == name:
                pointer.unlink()
        files.fsync_directory(self.root)
        self.notes.append(f"{name} fails to verify and was moved aside to {str(target)!r}: {problem}")

    def _finish_interrupted(self) -> None:
        files.remove_leftovers(self.root)
        leftovers = []
        for entry in self.root.iterdir():
            match = _LEFTOVER.fullmatch(entry.name)
            if match and entry.is_dir():
                leftovers.append((("tmp", "old", "del").index(match.group(2)), match.group(1), entry))
        for _, name, entry in sorted(leftovers):  # a complete .tmp is newer than an .old copy of the same step
            final = self.root / name
            problem = None if entry.name.endswith(".del") or final.exists() else check(entry)
            if problem is None and not entry.name.endswith(".del") and not final.exists():
                os.replace(entry, final)
                self.notes.append(f"finished the interrupted save of {name}")
            elif problem is not None and entry.name.endswith(".old"):  # a complete step, damaged since
                self._move_aside(entry, name, problem)
            else:  # a write that never finished, a deletion begun, or a copy superseded by the step itself
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


def check(step_dir: Path) -> str | None:
    """None when every file of a step directory is present and passes its digest; else what is wrong, naming it."""
    failed = first_failure(step_dir)
    return None if failed is None else failed[1]


def first_failure(step_dir: Path, *, weights_only: bool = False) -> tuple[Path, str] | None:
    """The first file of a step directory that is missing or fails its digest, and why; None when all verify.

    Args:
        weights_only: check the weights (and the head, when the step has one) but not the trainer state.
    """
    checks: list[tuple[str, Callable[[Path], object]]] = [(MODEL_FILE, checkpoint_io.read_info)]
    if (step_dir / TRAINABLE_FILE).exists():  # a pretrained model's run: only the trainable tensors
        checks = [(TRAINABLE_FILE, lambda p: integrity.load_sealed(p, "trainable parameters"))]
    if not weights_only:
        checks.append((TRAINER_FILE, lambda p: integrity.load_sealed(p, "training state")))
    if (step_dir / HEAD_FILE).exists():
        checks.append((HEAD_FILE, lambda p: integrity.load_sealed(p, "task head")))
    for name, verify in checks:
        try:
            verify(step_dir / name)
        except CheckpointError as error:
            return step_dir / name, str(error)
    return None


def verifies(step_dir: Path) -> bool:
    """Whether every file of a step directory is present and passes its digest."""
    return check(step_dir) is None


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
