"""What a trainer keeps of its run: the checkpoint of a step, the exact resume from the newest one that verifies,
the refusal to overwrite a run, and the run's ``config.json``.

Resume is exact: a checkpoint holds the weights, the optimizer moments, the step (the schedule is a function of
it), the data position and every rank's random generators. :class:`RunKeeping` is the part of
:class:`oneblock.train.loop.Trainer` that does this; the trainer supplies the attributes declared here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from oneblock.config import ModelConfig
from oneblock.errors import CheckpointError
from oneblock.io import files, integrity
from oneblock.train import distributed, rundir, sharding
from oneblock.train.checkpoints import CheckpointDir
from oneblock.train.config import TrainConfig
from oneblock.train.objectives import Objective
from oneblock.train.rundir import CONFIG_FILE
from oneblock.train.schedule import WarmupCosine
from oneblock.train.state import rng_state, set_rng_state


class RunKeeping:
    """Checkpoints, resume and the run's files, for a trainer that holds the attributes below."""

    cfg: TrainConfig
    model_cfg: ModelConfig
    model: nn.Module
    module: nn.Module
    objective: Objective
    optimizer: torch.optim.Optimizer
    schedule: WarmupCosine
    checkpoints: CheckpointDir | None
    ctx: distributed.Context
    run_dir: Path | None
    extra_config: dict[str, Any]
    notes: list[str]
    on_note: Callable[[str], None] | None
    step: int
    tokens: int
    elapsed: float
    _skeleton: nn.Module | None
    _head: nn.Module | None

    def _state(self, rngs: list[dict[str, Any]], data: dict[str, Any]) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens": self.tokens,
            "elapsed": self.elapsed,
            "world": self.ctx.world,
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.to_dict(),
            "data": data,
            "rng": rngs,
        }

    def save(self, *, rewind: dict[str, Any] | None = None) -> Path | None:
        """Checkpoint the current step (rank 0 writes; every rank must call it, unless ``rewind`` is given).

        Args:
            rewind: ``{"step", "rng", "data"}`` captured by ``_snapshot`` (at the start of an unfinished step, or
                now), saved instead of gathering the live values from every rank: the Ctrl-C path, where the other
                ranks may be anywhere. Every rank's generators are then saved as this rank's.
        """
        if self.checkpoints is None:
            return None
        if rewind is not None and self._skeleton is not None:  # gathering the shards takes every rank
            self._note("a Ctrl-C under FSDP saves nothing: resume from the last periodic checkpoint")
            return None
        if rewind is None:
            rngs, data = distributed.gather(rng_state(), self.ctx), self.objective.state_dict()
        else:
            rngs, data = [rewind["rng"]] * self.ctx.world, rewind["data"]
        state = self._state(rngs, data)
        if self._skeleton is not None:
            weights, state["optimizer"] = sharding.gather(self.module, self.optimizer)
        if not self.ctx.is_main:
            return None
        meta = {"task": self.cfg.task, "train": self.cfg.to_dict()}
        if self._skeleton is None:
            return self.checkpoints.save(self.step, self.model, state, head=self._head, metadata=meta)
        full = sharding.materialize(self._skeleton, weights)
        head = full if self._head is not None else None
        try:
            return self.checkpoints.save(self.step, self.objective.unwrap(full), state, head=head, metadata=meta)
        finally:
            sharding.release(self._skeleton)

    def _snapshot(self) -> dict[str, Any]:
        """This rank's step, generators and data position: what a resumed run needs to repeat a step."""
        return {"step": self.step, "rng": rng_state(), "data": self.objective.state_dict()}

    def _resume(self, *, weights_only: bool = False) -> bool:
        """Restore the newest complete checkpoint; False when the run has none and starts afresh (with a note).

        A run whose every step failed its check (and was moved aside) is refused, unless ``weights_only``.
        """
        if self.run_dir is not None:
            files.remove_leftovers(self.run_dir)  # a config.json write cut short
            rundir.check_same_data(self.run_dir / CONFIG_FILE, self.objective.source)
        checkpoints = self.checkpoints
        latest = checkpoints.recover() if checkpoints else None
        self._take_notes()
        if checkpoints is not None and latest is None and checkpoints.damaged_steps():
            if weights_only:  # the newest weights that verify; a fresh optimizer, data stream and generators
                restored = rundir.restore_weights(checkpoints, self.model, self._head, self.run_dir)
                self.step, self.tokens, self.elapsed, note = restored
                self._note(note)
                return True
            raise CheckpointError(rundir.none_verifies(checkpoints, self.run_dir))
        if checkpoints is None or latest is None:
            where = str(self.run_dir / "checkpoints") if self.run_dir else "memory"
            if self.run_dir is not None and (self.run_dir / CONFIG_FILE).exists():
                self._start_afresh(announce=False)
                self._note(f"no complete checkpoint in {where}: starting the run afresh from its config.json")
                return False
            raise CheckpointError(f"nothing to resume: no checkpoint in {where}; start the run without resume=True")
        if self._skeleton is not None:  # read into the unsharded structure, then shard into place
            full = sharding.allocate(self._skeleton)
            state = checkpoints.load(latest, self.objective.unwrap(full), head=full if self._head is not None else None)
        else:
            state = checkpoints.load(latest, self.model, head=self._head)
        if state["schedule"] != self.schedule.to_dict():
            raise CheckpointError(
                f"the checkpoint's schedule {state['schedule']} differs from this run's {self.schedule.to_dict()}; "
                "resume with the run's saved config"
            )
        if self._skeleton is not None:
            only = checkpoints.trainable_only  # then the checkpoint held the trainable tensors alone
            sharding.restore(self.module, self.optimizer, self._skeleton, state["optimizer"], trainable_only=only)
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.objective.load_state_dict(state["data"])
        rngs = state["rng"]
        set_rng_state(rngs[self.ctx.rank] if self.ctx.rank < len(rngs) else rngs[0])
        self.step, self.tokens, self.elapsed = int(state["step"]), int(state["tokens"]), float(state["elapsed"])
        return True

    def _start_afresh(self, *, announce: bool = True) -> None:
        """Refuse to overwrite a run with a complete checkpoint; clear what an unfinished first save left."""
        if self.checkpoints is None:
            return
        found = self.checkpoints.recover()
        self._take_notes()
        if found is not None:
            raise CheckpointError(
                f"{str(self.run_dir)!r} already holds a run; pass resume=True to continue it (its newest complete "
                f"checkpoint is {found.name}) or choose another run_dir"
            )
        if self.checkpoints.damaged_steps():
            raise CheckpointError(rundir.none_verifies(self.checkpoints, self.run_dir))
        if self.checkpoints.root.exists():
            if announce:
                self._note(f"{str(self.checkpoints.root)!r} holds no complete checkpoint: starting afresh")
            self.checkpoints.clear()

    def _note(self, message: str) -> None:
        self.notes.append(message)
        if self.on_note is not None:
            self.on_note(message)

    def _take_notes(self) -> None:
        if self.checkpoints is not None:
            for message in self.checkpoints.notes:
                self._note(message)
            self.checkpoints.notes.clear()

    def _write_config(self) -> None:
        if self.run_dir is None:  # an in-memory run keeps no files
            return
        payload = {"model": self.model_cfg.to_dict(), "train": self.cfg.to_dict(), "world": self.ctx.world}
        if self.objective.source is not None:
            payload["data"] = self.objective.source
        payload.update(self.extra_config)
        files.remove_leftovers(self.run_dir)  # a start cut short in this very write, before any config existed
        files.write_atomic(self.run_dir / CONFIG_FILE, integrity.dump_json(payload), what="run config")
