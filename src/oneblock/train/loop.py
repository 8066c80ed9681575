"""The trainer: AdamW, warmup + cosine, gradient clipping, held-out evaluation, checkpoints and exact resume.

One optimizer step::

    lr = schedule(step)                                   set on every parameter group
    batch = objective.next_batch(batch_size * grad_accum * world)   the global batch; this rank keeps its shard
    for each of the grad_accum micro-batches of the shard:
        loss = objective.loss(model, micro)               under bf16 autocast when asked
        (loss * share).backward()                         DDP averages the gradients across ranks at the last
    grad_norm = clip_grad_norm_(params, grad_clip)        the norm before clipping is logged
    optimizer.step()

Resume is exact: a checkpoint holds the weights, the optimizer moments, the step (the schedule is a function of
it), the data position and the random generators, so N steps in one go and N/2 + N/2 with a resume in between
take the same steps and log the same losses.

With ``checkpoint_activations`` the trainer sets every ``Stack`` of the model to checkpoint its blocks (the same
gradients, less memory, one more forward pass of the blocks).

A micro-batch's ``share`` of the step is its ``objective.loss_weight`` (its number of trained tokens, for
fine-tuning data where that varies) over the sum of all micro-batches of all ranks, so an accumulated step
computes the gradient of the mean over the whole step's targets: the same as one big batch.

The trainer trains what ``requires_grad`` says. It builds a fresh model from its config, or takes a pretrained
one (``model=``, with the ``objective=`` of its data); a pretrained model's checkpoints keep only the trainable
parameters (``CheckpointDir(trainable_only=True)``), its frozen part being loaded again from its source.

A Ctrl-C (``KeyboardInterrupt``) saves a checkpoint first; if it
lands before the update, the data position and generators are rewound to the start of that step so that the step
is simply run again after resuming; during the update it is held back until the step is complete and logged
(``oneblock.train.interrupts``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from oneblock.config import ModelConfig
from oneblock.errors import ConfigError, DivergenceError
from oneblock.io import files, limits
from oneblock.io.runlock import RunLock
from oneblock.models.build import build_model
from oneblock.models.inputs import config_of
from oneblock.models.stack import Stack
from oneblock.train import distributed, rundir, sharding
from oneblock.train.checkpoints import CheckpointDir
from oneblock.train.config import TrainConfig
from oneblock.train.interrupts import InterruptGuard
from oneblock.train.logbook import LOG_FILE, StepLog
from oneblock.train.objectives import Objective, make_objective
from oneblock.train.optim import make_optimizer
from oneblock.train.progress import TrainProgress
from oneblock.train.resume import RunKeeping
from oneblock.train.schedule import WarmupCosine

SUMMARY_FILE = "summary.json"


@dataclass
class TrainResult:
    """What a call to ``Trainer.train`` did.

    Attributes:
        step: optimizer steps completed in total (including those before a resume).
        losses: training loss of every step this call ran, in order.
        eval: held-out scores after the last step (empty when interrupted).
        interrupted: stopped by Ctrl-C (a checkpoint was saved).
        tokens: tokens processed over the whole run, all ranks together.
        elapsed: seconds of training over the whole run.
    """

    step: int
    losses: list[float] = field(default_factory=list)
    eval: dict[str, float] = field(default_factory=dict)
    interrupted: bool = False
    tokens: int = 0
    elapsed: float = 0.0


def fit_model_config(model_cfg: ModelConfig, train_cfg: TrainConfig, objective: Objective) -> ModelConfig:
    """``model_cfg`` with the family and vocabulary the task dictates; its context grown to the task's length.

    Keeps the sizes and the block design (width, heads, layers, norms, positions, ...); drops the parts that
    belong to another family or vocabulary (pooler, final-logits bias, special token ids).
    """
    changes: dict[str, Any] = {
        "arch": objective.arch,
        "vocab_size": objective.vocab_size,
        "max_seq_len": max(model_cfg.max_seq_len, objective.max_seq_len),
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
        "pooler": False,
        "final_logits_bias": model_cfg.final_logits_bias and objective.arch != "encoder",
        "scale_tied_logits": model_cfg.scale_tied_logits and objective.arch != "encoder",  # no LM head to rescale
    }
    if objective.arch != "encoder-decoder" or model_cfg.arch != "encoder-decoder":
        changes["n_decoder_layers"] = None
    return model_cfg.replace(**changes)


class Trainer(RunKeeping):
    """Trains one model on one task; writes the run directory on rank 0.

    Args:
        model_cfg: the model; its ``arch`` and ``vocab_size`` must be what the task needs (``fit_model_config``).
        cfg: the training settings.
        run_dir: where config, log, checkpoints and summary go; None keeps everything in memory (no checkpoints).
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:i``.
        quiet: no progress bar.
        on_step: called after every step as ``on_step(step, record)`` (tests use it to interrupt a run).
        on_note: called with each sentence of ``notes`` as it is found (the CLI prints them).
        model: a model to train instead of a fresh one built from ``model_cfg`` (whose config it then replaces);
            only its parameters with ``requires_grad`` train, and only they are checkpointed.
        objective: the objective to use instead of the one ``cfg.task`` names (its data and loss).
        extra_config: further JSON sections of the run's ``config.json`` (what rebuilds ``model`` on resume).
        stop_on_divergence: stop with a ``DivergenceError`` at the first non-finite loss, gradient norm or weight,
            before that step's update or anything non-finite is saved (else a diverged run goes on, and its
            losses say so: what the training experiments study).

    Raises:
        ConfigError: the model does not fit the task.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        cfg: TrainConfig,
        *,
        run_dir: str | Path | None = None,
        device: str = "auto",
        quiet: bool = True,
        on_step: Callable[[int, dict[str, Any]], None] | None = None,
        on_note: Callable[[str], None] | None = None,
        model: nn.Module | None = None,
        objective: Objective | None = None,
        extra_config: dict[str, Any] | None = None,
        stop_on_divergence: bool = False,
    ) -> None:
        self.cfg = cfg
        self.stop_on_divergence = stop_on_divergence
        self.extra_config = extra_config or {}
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.quiet = quiet
        self.on_step = on_step
        self.on_note = on_note
        self.ctx = distributed.setup(device)
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        self.objective = objective if objective is not None else make_objective(cfg)
        if model is not None:
            model_cfg = config_of(model)
        need = (self.objective.arch, self.objective.vocab_size)
        if (model_cfg.arch, model_cfg.vocab_size) != need or model_cfg.max_seq_len < self.objective.max_seq_len:
            raise ConfigError(
                f"task {cfg.task!r} needs arch={need[0]!r}, vocab_size={need[1]} and max_seq_len >= "
                f"{self.objective.max_seq_len}; got {model_cfg.arch!r}, {model_cfg.vocab_size}, "
                f"{model_cfg.max_seq_len}. Adapt the config with oneblock.train.fit_model_config"
            )
        self.model_cfg = model_cfg
        if model is None:
            limits.check_model_size(model_cfg, what="the model to train", error=ConfigError)
            self.model = build_model(model_cfg, device=self.ctx.device)
        else:
            self.model = model.to(self.ctx.device)  # any oneblock model family
        self.module = self.objective.wrap(self.model).to(self.ctx.device)
        for stack in (m for m in self.module.modules() if isinstance(m, Stack)):
            stack.checkpoint_activations = cfg.checkpoint_activations
        self.fsdp = cfg.fsdp and self.ctx.distributed
        self._skeleton = sharding.shard(self.module) if self.fsdp else None  # before the optimizer sees the params
        self.optimizer = make_optimizer(
            self.module, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2)
        )
        self.schedule = WarmupCosine(cfg.lr, cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio)
        self.checkpoints = (
            CheckpointDir(Path(run_dir) / "checkpoints", keep=cfg.keep_checkpoints, trainable_only=model is not None)
            if run_dir
            else None
        )
        self.step = 0
        self.tokens = 0
        self.elapsed = 0.0
        torch.manual_seed(cfg.seed + 1 + self.ctx.rank)  # each rank its own dropout masks
        self._head = self.module if self.module is not self.model else None
        self.ddp: nn.Module = self.module  # wrapped in DDP by train() when distributed
        self.interrupts = InterruptGuard()
        self.notes: list[str] = []  # what resuming found and did (a fallback to an older step, a fresh start)

    @classmethod
    def from_run(cls, run_dir: str | Path, **kwargs: Any) -> Trainer:
        """A trainer for an existing run directory, configured from its ``config.json``."""
        saved = rundir.read_config(run_dir, ("model", "train"), kind="training")
        return cls(
            ModelConfig.from_dict(saved["model"]), TrainConfig.from_dict(saved["train"]), run_dir=run_dir, **kwargs
        )

    # Training.
    def train_step(self) -> dict[str, Any]:
        """Run one optimizer step (``grad_accum`` micro-batches) and return its log record."""
        cfg, ctx = self.cfg, self.ctx
        start = time.perf_counter()
        lr = self.schedule.apply(self.optimizer, self.step)
        batch = self.objective.next_batch(cfg.batch_size * cfg.grad_accum * ctx.world)
        local = distributed.shard(batch, ctx)
        micro = [
            {k: v[i * cfg.batch_size : (i + 1) * cfg.batch_size].to(ctx.device) for k, v in local.items()}
            for i in range(cfg.grad_accum)
        ]
        weights = [self.objective.loss_weight(m) for m in micro]
        total = max(distributed.mean(sum(weights), ctx) * ctx.world, 1e-12)  # over the step, all ranks
        autocast = torch.autocast(device_type=ctx.device.type, dtype=torch.bfloat16) if cfg.bf16 else nullcontext()
        self.optimizer.zero_grad(set_to_none=True)
        step_loss, n_tokens = 0.0, 0
        for i, (part, weight) in enumerate(zip(micro, weights, strict=True)):
            no_sync = getattr(self.ddp, "no_sync", None)  # DDP: reduce the gradients once, after the last part
            with no_sync() if no_sync is not None and i < len(micro) - 1 else nullcontext():
                with autocast:
                    loss, n = self.objective.loss(self.ddp, part)
                # DDP divides the summed gradients by the world size; the share undoes that for a global mean.
                (loss * (weight * ctx.world / total)).backward()
            step_loss += float(loss.detach()) * weight / total
            n_tokens += n
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        loss_value, norm = distributed.mean(step_loss, ctx) * ctx.world, sharding.norm_value(grad_norm)
        if self.stop_on_divergence:  # the same values on every rank, so every rank stops here
            for what, value in (("training loss", loss_value), ("gradient norm", norm)):
                if not math.isfinite(value):
                    raise self._diverged(self.step + 1, f"its {what} is {value}")
        with self.interrupts.hold():  # the update and the counters change together or not at all
            self.optimizer.step()
            self.step += 1
            seconds = time.perf_counter() - start
            self.elapsed += seconds
            tokens = n_tokens * ctx.world
            self.tokens += tokens
        if self.stop_on_divergence and not self._weights_finite():
            raise self._diverged(self.step, "its update made weights non-finite")
        return {
            "step": self.step,
            "loss": loss_value,
            "lr": lr,
            "grad_norm": norm,
            "tokens": self.tokens,
            "tokens_per_s": tokens / max(seconds, 1e-9),
            "elapsed": round(self.elapsed, 4),
            **self.objective.step_metrics(),
        }

    def _weights_finite(self) -> bool:
        """Whether every trainable weight (this rank's shard of it) is finite, on every rank."""
        local = all(
            bool(torch.isfinite(getattr(p, "to_local", lambda p=p: p)()).all())
            for p in self.module.parameters()
            if p.requires_grad
        )
        return distributed.mean(float(local), self.ctx) == 1.0

    def _diverged(self, step: int, what: str) -> DivergenceError:
        kept = self.checkpoints.latest() if self.checkpoints is not None and self.ctx.is_main else None
        where = f"the last checkpoint, {kept.name}, is kept" if kept is not None else "no checkpoint was written"
        return DivergenceError(
            f"step {step}: the run diverged, {what}; it stops without saving ({where}); lower lr ({self.cfg.lr:g})"
        )

    def evaluate(self) -> dict[str, float]:
        """Held-out scores of the current model (computed by every rank on the same data)."""
        return self.objective.evaluate(self.module)

    def train(self, *, resume: bool = False, weights_only: bool = False) -> TrainResult:
        """Train to ``cfg.steps``, from scratch or from the run's latest checkpoint.

        The main process holds the run directory's lock (``oneblock.io.runlock``) from before it reads the
        checkpoints until the last file is written.

        Args:
            resume: continue from the newest checkpoint that verifies.
            weights_only: with ``resume``, when no checkpoint verifies whole (its steps were moved aside to
                ``checkpoints/damaged``), continue from the newest weights that verify, with a fresh optimizer
                state, data stream and random generators.

        Raises:
            CheckpointError: another process holds the run directory, ``resume`` without a checkpoint, or a
                checkpoint of another configuration.
        """
        lock = None
        if self.run_dir is not None and self.ctx.is_main:
            lock = RunLock(self.run_dir, command="oneblock train" + " --resume" * resume).acquire()
        try:
            return self._train(resume=resume, weights_only=weights_only)
        finally:
            if lock is not None:
                lock.release()

    def _train(self, *, resume: bool, weights_only: bool) -> TrainResult:
        cfg, ctx = self.cfg, self.ctx
        resumed = self._resume(weights_only=weights_only) if resume else False
        run_dir = self.run_dir if ctx.is_main else None  # only the main rank writes the run's files
        if run_dir is not None and not resume:
            self._start_afresh()
        self.ddp = self.module if self.fsdp else distributed.wrap(self.module, ctx)
        if run_dir is not None and not resumed:
            self._write_config()
        log = StepLog(run_dir / LOG_FILE, resume_step=self.step if resumed else None) if run_dir is not None else None
        if log is not None and log.note is not None:
            self._note(log.note)
        result = TrainResult(step=self.step)
        self.module.train()
        rewind = None
        try:
            with TrainProgress(cfg.steps, start=self.step, enabled=ctx.is_main and not self.quiet) as bar:
                while self.step < cfg.steps:
                    rewind = self._snapshot()
                    record = self.train_step()
                    result.losses.append(record["loss"])
                    if log:
                        log.write(record)
                    bar.update(self.step, record["loss"], record["tokens_per_s"])
                    if not math.isfinite(record["loss"]):
                        bar.log(f"[red]step {self.step}: loss is {record['loss']}; the run has diverged")
                    if ctx.is_main and cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
                        scores = self.evaluate()
                        if log:
                            log.write({"step": self.step, "eval": scores})
                        bar.log(f"step {self.step}: held-out " + _format(scores))
                    if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps:
                        self.save()
                    if self.on_step is not None:
                        self.on_step(self.step, record)
                    self.interrupts.check()  # a Ctrl-C held back during the update stops here
        except KeyboardInterrupt:
            # No collective calls here: the other ranks may be anywhere. Before the update, rewind to the step's
            # start; after it, the step is complete and the live state is the one to keep.
            unfinished = rewind is not None and rewind["step"] == self.step
            self.save(rewind=rewind if unfinished else self._snapshot())
            result.interrupted = True
        else:
            self.save()
            result.eval = self.evaluate() if ctx.is_main else {}
            if log:
                log.write({"step": self.step, "eval": result.eval})
            if run_dir is not None:
                summary = {"step": self.step, "tokens": self.tokens, "elapsed": self.elapsed, "eval": result.eval}
                files.write_atomic(run_dir / SUMMARY_FILE, [json.dumps(summary, indent=2).encode()], what="summary")
        finally:
            if log:
                log.close()
        result.step, result.tokens, result.elapsed = self.step, self.tokens, self.elapsed
        return result


def _format(scores: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in scores.items())
