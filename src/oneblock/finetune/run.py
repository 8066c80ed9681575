"""A fine-tuning run: a pretrained model, its data, LoRA adapters or every parameter, on the project's trainer.

``prepare`` turns a ``FinetuneConfig`` (what to adapt, with what) and a ``TrainConfig`` (how) into a ``Trainer``
over the loaded model; the trainer knows nothing of LoRA, it trains what ``requires_grad`` says. The run
directory's ``config.json`` records both, so ``resume`` rebuilds the same model (loaded again from its source,
the same adapters initialized with the same seed) and continues from the newest checkpoint exactly. ``finish``
writes what the run was for: ``adapter_config.json`` + ``adapter_model.safetensors`` (peft's format) for LoRA,
``model.safetensors`` (a oneblock checkpoint) for full fine-tuning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from oneblock.adapters.apply import apply_lora
from oneblock.adapters.lora import LoraConfig
from oneblock.adapters.peft import save_adapter
from oneblock.errors import CheckpointError, ConfigError
from oneblock.finetune.examples import build_examples
from oneblock.finetune.objective import SupervisedObjective
from oneblock.finetune.pairs import PairExample, build_pairs, read_pairs
from oneblock.finetune.preference import DEFAULT_BETA, PreferenceObjective, check_beta
from oneblock.finetune.records import Dataset, read_data
from oneblock.finetune.tokenize import Example
from oneblock.text.tokenizer import Tokenizer
from oneblock.train import rundir
from oneblock.train.config import TrainConfig
from oneblock.train.data import fingerprint
from oneblock.train.loop import Trainer

METHODS = ("lora", "full", "dpo", "dpo-full")  # dpo: DPO on LoRA adapters; dpo-full: DPO on every parameter
ADAPTER_METHODS = ("lora", "dpo")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODEL_FILE = "model.safetensors"
E = TypeVar("E")  # a tokenized example, or a pair of them


@dataclass(frozen=True)
class FinetuneConfig:
    """What a fine-tuning run adapts and on which data.

    Attributes:
        model: anything ``oneblock.load_model`` accepts (a GGUF file, a Hugging Face directory, a checkpoint).
        data: the training data file (see ``oneblock.finetune.records``).
        method: ``lora`` (adapters only) or ``full`` (every parameter), on supervised data; ``dpo`` (adapters)
            or ``dpo-full`` (every parameter) on preference pairs (``oneblock.finetune.pairs``).
        lora: the adapters' settings (``lora`` and ``dpo``).
        dtype: ``None`` keeps the source's weights (a GGUF file's 4-bit matrices as stored), or ``float32``.
        pack: several short examples per row.
        truncate: cut examples longer than the window instead of refusing them.
        eval_data: a held-out data file.
        eval_share: otherwise, the share of the examples held out (0: none).
        beta: DPO's beta (``dpo`` and ``dpo-full``).
    """

    model: str
    data: str
    method: str = "lora"
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    dtype: str | None = None
    pack: bool = False
    truncate: bool = False
    eval_data: str | None = None
    eval_share: float = 0.0
    beta: float = DEFAULT_BETA

    @property
    def adapters(self) -> bool:
        """Whether the run trains LoRA adapters (else every parameter)."""
        return self.method in ADAPTER_METHODS

    @property
    def preference(self) -> bool:
        """Whether the data are preference pairs trained with DPO."""
        return self.method.startswith("dpo")

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if not 0.0 <= self.eval_share < 1.0:
            raise ConfigError(f"eval_share must lie in [0, 1); got {self.eval_share!r}")
        check_beta(self.beta)
        if self.preference and (self.pack or self.truncate):
            raise ConfigError("DPO keeps every pair whole in its own rows; drop pack=True and truncate=True")
        if self.eval_data is not None and self.eval_share:
            raise ConfigError("give eval_data or eval_share, not both")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["lora"]["targets"] = list(self.lora.targets)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FinetuneConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) - known or not isinstance(data.get("lora"), dict):
            raise CheckpointError(f"the run's 'finetune' section is malformed; expected the fields {sorted(known)}")
        return cls(**{**data, "lora": LoraConfig(**{**data["lora"], "targets": tuple(data["lora"]["targets"])})})


def split_examples(examples: list[E], share: float, seed: int) -> tuple[list[E], list[E]]:
    """``(train, held_out)``: a random ``share`` of the examples (or pairs; at least one when ``share > 0``) held
    out."""
    if not share:
        return examples, []
    n_out = max(1, round(len(examples) * share))
    if n_out >= len(examples):
        raise ConfigError(
            f"eval_share {share} of {len(examples)} examples leaves none to train on; lower it or add data"
        )
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    return [examples[i] for i in order[n_out:]], [examples[i] for i in order[:n_out]]


def pad_id_of(tokenizer: Tokenizer) -> int:
    """The id that fills padding: the tokenizer's pad token, else its end-of-text, else 0 (never attended to)."""
    pad = getattr(tokenizer, "pad_id", None)
    return int(pad if pad is not None else tokenizer.eos_id if tokenizer.eos_id is not None else 0)


@dataclass
class FinetuneRun:
    """A prepared run: the trainer over the adapted model, what it adapts, and the model's tokenizer."""

    trainer: Trainer
    config: FinetuneConfig
    tokenizer: Tokenizer
    n_examples: int


def base_identity(model: nn.Module) -> dict[str, Any]:
    """What a base model is, for refusing another one: its tensors' count and a digest of their names, shapes and
    dtypes (the structure, which any other model of another size or family changes)."""
    entries = [f"{k}:{tuple(v.shape)}:{v.dtype}" for k, v in model.state_dict().items()]
    digest = hashlib.sha256("\n".join(entries).encode()).hexdigest()
    return {"tensors": len(entries), "structure_sha256": digest}


def prepare(
    ft: FinetuneConfig,
    cfg: TrainConfig,
    *,
    run_dir: str | Path | None,
    expect_base: dict[str, Any] | None = None,
    fit_context: bool = False,
    **trainer_kwargs: Any,
) -> FinetuneRun:
    """Load the model and the data, add adapters (or unfreeze everything), and build the trainer.

    Args:
        ft, cfg: what to adapt and how to train.
        run_dir: the run directory (None: in memory).
        expect_base: the ``base_identity`` a resumed run recorded; another base is refused.
        fit_context: shorten a ``seq_len`` longer than the model's context to it (a default, not a user's value).
        **trainer_kwargs: for ``Trainer`` (``device``, ``quiet``, ``on_step``, ``on_note``); a fine-tuning run stops
            at the first non-finite loss unless ``stop_on_divergence=False``.

    Raises:
        ConfigError: full fine-tuning of 4-bit weights, a window longer than the model's context, or settings
            that do not fit the data.
        InputError: bad data (see ``oneblock.finetune.records`` and ``examples``).
    """
    from oneblock.inference.load import load_model
    from oneblock.models.inputs import config_of

    dtype = DTYPES[ft.dtype] if ft.dtype is not None else None
    loaded = load_model(ft.model, dtype=dtype)
    model, tokenizer = loaded.model, loaded.tokenizer
    identity = base_identity(model)
    if expect_base is not None and identity != expect_base:
        raise CheckpointError(
            f"the run was trained on a base with identity {expect_base}, but {ft.model!r} now loads one with "
            f"{identity}; resume on the run's own base model"
        )
    context = config_of(model).max_seq_len
    if fit_context and cfg.seq_len is not None and cfg.seq_len > context:
        cfg = cfg.replace(seq_len=context)
    if cfg.seq_len is not None and cfg.seq_len > context:
        raise ConfigError(f"seq_len {cfg.seq_len} exceeds the model's context of {config_of(model).max_seq_len}")
    objective: SupervisedObjective | PreferenceObjective
    vocab_size, pad_id = config_of(model).vocab_size, pad_id_of(tokenizer)
    tell = trainer_kwargs.get("on_note") or _warn
    if ft.preference:
        pairs, held_pairs = _pairs(ft, cfg, tokenizer)
        cfg = fit_batch(cfg, len(pairs), "preference pairs", tell=tell)
        torch.manual_seed(cfg.seed)
        _adapt(model, ft)
        objective = PreferenceObjective(
            cfg, pairs, held_pairs, model=model, vocab_size=vocab_size, pad_id=pad_id, beta=ft.beta
        )
        objective.source = fingerprint(ft.data, Path(ft.data).read_bytes())  # a resume on other data is refused
        n_train = len(pairs)
    else:
        data, train, held_out = _examples(ft, cfg, tokenizer, tell=tell)
        cfg = fit_batch(cfg, len(train), "training examples", tell=tell)
        torch.manual_seed(cfg.seed)  # the adapters' initialization, the same on every rank and on resume
        _adapt(model, ft)
        objective = SupervisedObjective(cfg, train, held_out, vocab_size=vocab_size, pad_id=pad_id, packed=ft.pack)
        # A resume on other data is refused; the digest is the one taken while the file was read.
        objective.source = {"text": str(ft.data), "bytes": data.nbytes, "sha256": data.sha256}
        n_train = len(train)
    trainer = Trainer(
        config_of(model),
        cfg,
        run_dir=run_dir,
        model=model,
        objective=objective,
        extra_config={"finetune": ft.to_dict(), "base": identity},
        **{"stop_on_divergence": True, **trainer_kwargs},
    )
    return FinetuneRun(trainer, ft, tokenizer, n_train)


def _examples(
    ft: FinetuneConfig, cfg: TrainConfig, tokenizer: Tokenizer, *, tell: Callable[[str], None]
) -> tuple[Dataset, list[Example], list[Example]]:
    """``(the training data, training examples, held-out examples)``; held-out data that is the training data is
    refused, and held-out examples that are also training examples are told (``tell``)."""
    assert cfg.seq_len is not None  # TrainConfig sets it
    data = read_data(ft.data)
    examples = build_examples(data, tokenizer, seq_len=cfg.seq_len, truncate=ft.truncate)
    if ft.eval_data is None:
        train, held_out = split_examples(examples, ft.eval_share, cfg.seed)
    else:
        evaluation = read_data(ft.eval_data)
        if _same_file(data.path, evaluation.path) or (data.nbytes, data.sha256) == (
            evaluation.nbytes,
            evaluation.sha256,
        ):
            raise ConfigError(
                f"eval_data {str(ft.eval_data)!r} holds the same data as the training data {str(ft.data)!r}, so its "
                "figures would score the training examples, not held-out ones; give eval_data a file of other "
                "examples, or hold out a share of the training data with eval_share"
            )
        train = examples
        held_out = build_examples(evaluation, tokenizer, seq_len=cfg.seq_len, truncate=ft.truncate)
    note = overlap_note(train, held_out)
    if note is not None:
        tell(note)
    return data, train, held_out


def fit_batch(cfg: TrainConfig, n_train: int, what: str, *, tell: Callable[[str], None]) -> TrainConfig:
    """``cfg`` with a micro-batch of at most the ``n_train`` examples (or pairs) there are (told): a larger one
    would only repeat them, at the memory of rows that teach nothing new."""
    if cfg.batch_size <= n_train:
        return cfg
    tell(f"batch_size {cfg.batch_size} is more than the {n_train} {what}; each micro-batch holds {n_train}")
    return cfg.replace(batch_size=n_train)


def overlap_note(train: Sequence[Example], held_out: Sequence[Example]) -> str | None:
    """A sentence saying how many held-out examples are token for token training examples; None if none are."""
    seen = {e.ids for e in train}
    shared = [e for e in held_out if e.ids in seen]
    if not shared:
        return None
    return (
        f"{len(shared)} of {len(held_out)} held-out examples (e.g. {shared[0].where}) are also training examples, "
        "token for token: the held-out figures overstate how well the model generalizes; remove them from one side"
    )


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def _pairs(ft: FinetuneConfig, cfg: TrainConfig, tokenizer: Tokenizer) -> tuple[list[PairExample], list[PairExample]]:
    """The training and held-out preference pairs (``--eval`` or ``--eval-share``, as for supervised data)."""
    assert cfg.seq_len is not None  # TrainConfig sets it
    pairs = build_pairs(read_pairs(ft.data), tokenizer, seq_len=cfg.seq_len)
    if ft.eval_data is not None:
        return pairs, build_pairs(read_pairs(ft.eval_data), tokenizer, seq_len=cfg.seq_len)
    return split_examples(pairs, ft.eval_share, cfg.seed)


def _adapt(model: nn.Module, ft: FinetuneConfig) -> None:
    """Add the adapters (LoRA), or make every parameter trainable (full)."""
    if ft.adapters:
        apply_lora(model, ft.lora)
    else:
        _unfreeze(model)


def _unfreeze(model: nn.Module) -> None:
    """Every parameter trains; a quantized matrix (codes in a buffer, no float weight parameter) cannot."""
    quantized = [
        name
        for name, m in model.named_modules()
        if hasattr(m, "in_features") and not isinstance(getattr(m, "weight", None), nn.Parameter)
    ]
    if quantized:
        raise ConfigError(
            f"full fine-tuning needs float weights, and {len(quantized)} matrices of this model are "
            "4-bit; pass dtype='float32' to train the dequantized model, or method='lora' to train adapters over it"
        )
    for parameter in model.parameters():
        parameter.requires_grad_(True)


def read_run(run_dir: str | Path) -> tuple[FinetuneConfig, TrainConfig, dict[str, Any] | None]:
    """The settings a fine-tuning run directory was started with (its ``config.json``) and its base's identity."""
    saved = rundir.read_config(run_dir, ("finetune", "train"), kind="finetune")
    base = saved.get("base")
    return FinetuneConfig.from_dict(saved["finetune"]), TrainConfig.from_dict(saved["train"]), base


def finish(run: FinetuneRun, out: str | Path) -> list[Path]:
    """Write the run's product into ``out``: the peft adapter (LoRA) or the whole model (full); the paths."""
    ft, trainer, out = run.config, run.trainer, Path(out)
    model = trainer.model.eval() if not trainer.fsdp else _from_last_checkpoint(run)
    if ft.adapters:
        return [save_adapter(model, out, cfg=ft.lora, base=os.fspath(ft.model))]
    from oneblock.io.checkpoint import save

    path = out / MODEL_FILE
    save(model, path, metadata={"finetuned_from": os.fspath(ft.model), "step": trainer.step})
    return [path]


def _from_last_checkpoint(run: FinetuneRun) -> nn.Module:
    """The trained model rebuilt in this one process from the run's last checkpoint (gathered on rank 0): what a
    sharded run writes its product from, its own parameters being shards."""
    from oneblock.inference.load import load_model
    from oneblock.train.checkpoints import TRAINABLE_FILE, load_trainable

    ft, checkpoints = run.config, run.trainer.checkpoints
    latest = checkpoints.latest() if checkpoints is not None else None
    if latest is None:
        raise CheckpointError("a sharded run keeps its weights in its checkpoints, and this one has none")
    model = load_model(ft.model, dtype=DTYPES[ft.dtype] if ft.dtype is not None else None).model
    _adapt(model, ft)
    load_trainable(latest / TRAINABLE_FILE, model)
    return model.eval()
