"""``TrainConfig``: what to learn and how, validated once and saved with every run as JSON."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from oneblock.errors import ConfigError

TASKS = ("lm", "mlm", "reverse", "sort", "copy", "majority", "finetune")
TEXT_SEQ_LEN = 64  # bytes per training window
SYNTHETIC_SEQ_LEN = 8  # symbols per synthetic sequence: long enough to need attention, short enough to learn fast
TASK_ARCH = {
    "lm": "decoder",  # next-byte prediction on text
    "mlm": "encoder",  # masked-byte prediction on text
    "majority": "encoder",  # sequence classification
    "reverse": "encoder-decoder",
    "sort": "encoder-decoder",
    "copy": "encoder-decoder",
    "finetune": "decoder",  # supervised data of a pretrained model (oneblock.finetune)
}


@dataclass(frozen=True)
class TrainConfig:
    """Training settings. ``batch_size`` is per process and micro-batch: an optimizer step takes
    ``batch_size * grad_accum * world`` examples.

    Raises:
        ConfigError: on an unknown task or an impossible value, naming it.
    """

    task: str = "lm"
    text: str | None = None  # UTF-8 file for lm / mlm; None means the shipped corpus
    steps: int = 500
    batch_size: int = 16
    grad_accum: int = 1  # micro-batches of batch_size per optimizer step
    seq_len: int | None = None  # text window (default 64), or the length L of a synthetic sequence (default 8)
    n_symbols: int = 10  # alphabet of the synthetic tasks
    mask_prob: float = 0.15  # mlm: share of positions to predict
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.1  # on Linear weight matrices only
    beta1: float = 0.9
    beta2: float = 0.98
    grad_clip: float = 1.0  # max global gradient norm; 0 switches clipping off
    val_fraction: float = 0.1  # held-out tail of the text
    eval_every: int = 100  # 0: evaluate only at the end
    eval_examples: int = 256  # held-out windows or synthetic examples
    save_every: int = 100  # 0: checkpoint only at the end
    keep_checkpoints: int = 2
    seed: int = 0
    fsdp: bool = False  # under torchrun: shard parameters, gradients and optimizer state (FSDP2) instead of DDP
    bf16: bool = False  # bfloat16 autocast for the forward pass; parameters and optimizer stay float32
    # Keep only each block's input for the backward pass and run the block again there (less memory, one more
    # forward pass of the blocks; the same gradients).
    checkpoint_activations: bool = False

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"task must be one of {', '.join(TASKS)}; got {self.task!r}")
        if self.seq_len is None:  # frozen: set the task's default once, so to_dict records the value used
            object.__setattr__(self, "seq_len", TEXT_SEQ_LEN if self.is_text else SYNTHETIC_SEQ_LEN)
        for name in ("steps", "batch_size", "grad_accum", "seq_len", "eval_examples", "keep_checkpoints"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer; got {value!r}")
        for name in ("warmup_steps", "eval_every", "save_every", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer; got {value!r}")
        if self.seed >= 2**63:
            raise ConfigError(f"seed must be an integer in [0, 2**63); got {self.seed}")
        for name in ("n_symbols",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an integer; got {value!r}")
        for name in ("mask_prob", "lr", "min_lr_ratio", "weight_decay", "beta1", "beta2", "grad_clip", "val_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number; got {value!r}")
        for name in ("bf16", "fsdp", "checkpoint_activations"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False; got {getattr(self, name)!r}")
        if self.text is not None and not isinstance(self.text, str):
            raise ConfigError(f"text must be a file path (a string) or None; got {self.text!r}")
        if self.warmup_steps > self.steps:
            raise ConfigError(f"warmup_steps ({self.warmup_steps}) must not exceed steps ({self.steps})")
        if not self.lr > 0:
            raise ConfigError(f"lr must be positive; got {self.lr!r}")
        for name, low, high in (
            ("min_lr_ratio", 0.0, 1.0),
            ("beta1", 0.0, 1.0),
            ("beta2", 0.0, 1.0),
            ("val_fraction", 0.0, 1.0),
        ):
            value = getattr(self, name)
            if not low <= value <= high:
                raise ConfigError(f"{name} must lie in [{low}, {high}]; got {value!r}")
        if not 0.0 < self.mask_prob <= 1.0:
            raise ConfigError(f"mask_prob must lie in (0, 1]; got {self.mask_prob!r}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError(
                f"weight_decay ({self.weight_decay}) and grad_clip ({self.grad_clip}) must be non-negative"
            )
        if self.task in ("reverse", "sort", "copy", "majority") and self.n_symbols < 2:
            raise ConfigError(f"n_symbols must be at least 2 for task {self.task!r}; got {self.n_symbols}")

    @property
    def arch(self) -> str:
        """The model family the task needs."""
        return TASK_ARCH[self.task]

    @property
    def is_text(self) -> bool:
        return self.task in ("lm", "mlm")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from a dict, refusing unknown keys."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown training field(s) {unknown}; known fields are {sorted(known)}")
        return cls(**data)

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)
