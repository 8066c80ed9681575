"""Objectives: for each task, the data stream, the model wrapping, the loss of a batch and the held-out scores.

========  ===============  =================================================  ==================================
task      model            loss                                               held-out scores
========  ===============  =================================================  ==================================
lm        decoder          next-byte cross-entropy                            loss, next-byte accuracy
mlm       encoder + head   cross-entropy on the masked positions              loss, masked-byte accuracy
majority  encoder + head   cross-entropy of the class                         loss, accuracy
reverse,  encoder-decoder  cross-entropy of the target (teacher forcing)      loss, token accuracy, exact match
sort,                                                                         of greedy decoding
copy
========  ===============  =================================================  ==================================

A batch is a dict of tensors whose first axis is the example; the loop shards it across processes.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from oneblock.errors import ConfigError
from oneblock.models.encoder import Encoder
from oneblock.models.encoder_decoder import EncoderDecoder
from oneblock.models.heads import EncoderClassifier, EncoderMaskedLM
from oneblock.train import data, tasks
from oneblock.train.config import TrainConfig
from oneblock.train.masking import IGNORE, mask_tokens

M = TypeVar("M", bound=nn.Module)
_EVAL_SEED_OFFSET = 1_000_003  # the held-out synthetic examples come from a different seed than training


class Objective:
    """The interface the loop uses; one subclass per kind of task.

    Attributes:
        arch, vocab_size, max_seq_len: what the model must be.
        source: what the text was read from, recorded in the run so that a resume refuses other data.
    """

    arch: str
    vocab_size: int
    max_seq_len: int
    source: dict[str, Any] | None = None  # data.fingerprint of the text; None for the synthetic tasks

    def __init__(self, cfg: TrainConfig) -> None:
        if cfg.seq_len is None:  # TrainConfig.__post_init__ sets the task's default
            raise ConfigError("TrainConfig.seq_len is None; build the config with TrainConfig(...)")
        self.cfg = cfg
        self.seq_len: int = cfg.seq_len  # the text window T, or the length L of a synthetic sequence

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module to train around a freshly built oneblock model (a head, or the model itself)."""
        return model

    @staticmethod
    def unwrap(module: nn.Module) -> nn.Module:
        """The oneblock model inside a trained module (what a checkpoint stores)."""
        return module.encoder if isinstance(module, (EncoderClassifier, EncoderMaskedLM)) else module

    def next_batch(self, n: int) -> dict[str, Tensor]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The data position: enough to continue the stream exactly."""
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def loss(self, module: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
        """Mean loss of a batch and the number of tokens it fed to the model."""
        raise NotImplementedError

    def step_metrics(self) -> dict[str, float]:
        """Figures of the step just taken for its log record, beyond the loss (this process's; none by default)."""
        return {}

    def loss_weight(self, batch: dict[str, Tensor]) -> float:
        """How much of an optimizer step's loss a micro-batch carries, relative to the others (its number of
        targets where micro-batches differ in it; equal shares here, as every micro-batch has as many)."""
        return 1.0

    def evaluate(self, module: nn.Module, batch_size: int = 64) -> dict[str, float]:
        """Scores on the held-out set (the module is switched to eval mode and back)."""
        raise NotImplementedError

    def _read_text(self, cfg: TrainConfig, window: int) -> Tensor:
        """Read the text (recording its fingerprint), keep its training part as shuffled ``window``-byte windows
        in ``self.windows``, and return the held-out bytes (N,)."""
        self.max_seq_len = self.seq_len
        raw = data.read_text(cfg.text)
        self.source = data.fingerprint(cfg.text, raw)
        train, held_out = data.split(data.encode(raw), cfg.val_fraction, window)
        self.windows = data.TextWindows(train, window, seed=cfg.seed)
        return held_out


class LanguageModeling(Objective):
    """Next-byte prediction with a decoder: inputs are a window's first T bytes, targets its last T."""

    arch = "decoder"
    vocab_size = data.BYTE_VOCAB

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        held_out = self._read_text(cfg, self.seq_len + 1)
        self.eval_set = data.eval_windows(held_out, self.seq_len + 1, cfg.eval_examples)  # (W, T + 1)

    def next_batch(self, n: int) -> dict[str, Tensor]:
        return {"tokens": self.windows.next(n)}

    def state_dict(self) -> dict[str, Any]:
        return {"windows": self.windows.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.windows.load_state_dict(state["windows"])

    def loss(self, module: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
        tokens = batch["tokens"]  # (B, T + 1)
        logits = module(tokens[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        return loss, tokens[:, :-1].numel()

    @torch.no_grad()
    def evaluate(self, module: nn.Module, batch_size: int = 64) -> dict[str, float]:
        device = next(module.parameters()).device
        total, correct, count = 0.0, 0, 0
        with _eval_mode(module):
            for chunk in self.eval_set.split(batch_size):
                chunk = chunk.to(device)
                logits = module(chunk[:, :-1]).float()  # (b, T, V)
                target = chunk[:, 1:]
                total += float(F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum"))
                correct += int((logits.argmax(-1) == target).sum())
                count += target.numel()
        return {"loss": total / count, "accuracy": correct / count}


class MaskedLanguageModeling(Objective):
    """Masked-byte prediction with an encoder (vocabulary: 256 bytes plus ``[MASK]`` = 256)."""

    arch = "encoder"
    vocab_size = data.BYTE_VOCAB + 1
    mask_id = data.BYTE_VOCAB

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        held_out = self._read_text(cfg, self.seq_len)
        self.masking = torch.Generator().manual_seed(cfg.seed + 1)
        windows = data.eval_windows(held_out, self.seq_len, cfg.eval_examples)
        fixed = torch.Generator().manual_seed(cfg.seed + _EVAL_SEED_OFFSET)
        self.eval_inputs, self.eval_labels = self._mask(windows, fixed)

    def _mask(self, tokens: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        return mask_tokens(
            tokens, mask_id=self.mask_id, n_real=data.BYTE_VOCAB, prob=self.cfg.mask_prob, generator=generator
        )

    def wrap(self, model: nn.Module) -> nn.Module:
        return EncoderMaskedLM(_expect(model, Encoder))

    def next_batch(self, n: int) -> dict[str, Tensor]:
        inputs, labels = self._mask(self.windows.next(n), self.masking)
        return {"tokens": inputs, "labels": labels}

    def state_dict(self) -> dict[str, Any]:
        return {"windows": self.windows.state_dict(), "masking": self.masking.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.windows.load_state_dict(state["windows"])
        self.masking.set_state(state["masking"])

    def loss(self, module: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
        logits = module(batch["tokens"])  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=IGNORE)
        return loss, batch["tokens"].numel()

    @torch.no_grad()
    def evaluate(self, module: nn.Module, batch_size: int = 64) -> dict[str, float]:
        device = next(module.parameters()).device
        total, correct, count = 0.0, 0, 0
        with _eval_mode(module):
            chunks = zip(self.eval_inputs.split(batch_size), self.eval_labels.split(batch_size), strict=True)
            for inputs, labels in chunks:
                logits = module(inputs.to(device)).float()  # (b, T, V)
                labels = labels.to(device)
                chosen = labels != IGNORE
                total += float(F.cross_entropy(logits[chosen], labels[chosen], reduction="sum"))
                correct += int((logits[chosen].argmax(-1) == labels[chosen]).sum())
                count += int(chosen.sum())
        return {"loss": total / count, "accuracy": correct / count}


class _Synthetic(Objective):
    """Shared stream handling of the synthetic tasks."""

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        self.max_seq_len = self.seq_len + 1  # BOS or CLS plus L symbols
        self.stream = tasks.SyntheticStream(cfg.task, length=self.seq_len, n_symbols=cfg.n_symbols, seed=cfg.seed)
        held_out = tasks.SyntheticStream(
            cfg.task, length=self.seq_len, n_symbols=cfg.n_symbols, seed=cfg.seed + _EVAL_SEED_OFFSET
        )
        self.eval_set = held_out.next(cfg.eval_examples)

    def next_batch(self, n: int) -> dict[str, Tensor]:
        return self.stream.next(n)

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])

    def eval_chunks(self, batch_size: int, device: torch.device) -> list[dict[str, Tensor]]:
        n = len(next(iter(self.eval_set.values())))
        return [
            {k: v[i : i + batch_size].to(device) for k, v in self.eval_set.items()} for i in range(0, n, batch_size)
        ]


class Classification(_Synthetic):
    """Majority-symbol classification with an encoder and a classifier on the CLS position."""

    arch = "encoder"

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        self.vocab_size = 1 + cfg.n_symbols
        self.n_classes = cfg.n_symbols

    def wrap(self, model: nn.Module) -> nn.Module:
        return EncoderClassifier(_expect(model, Encoder), self.n_classes)

    def loss(self, module: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
        logits = module(batch["tokens"])  # (B, n_classes)
        return F.cross_entropy(logits.float(), batch["labels"]), batch["tokens"].numel()

    @torch.no_grad()
    def evaluate(self, module: nn.Module, batch_size: int = 64) -> dict[str, float]:
        device = next(module.parameters()).device
        total, correct, count = 0.0, 0, 0
        with _eval_mode(module):
            for chunk in self.eval_chunks(batch_size, device):
                logits = module(chunk["tokens"]).float()  # (b, n_classes)
                total += float(F.cross_entropy(logits, chunk["labels"], reduction="sum"))
                correct += int((logits.argmax(-1) == chunk["labels"]).sum())
                count += len(logits)
        return {"loss": total / count, "accuracy": correct / count}


class SequenceToSequence(_Synthetic):
    """Reverse, sort or copy a sequence with an encoder-decoder; scored by greedy decoding."""

    arch = "encoder-decoder"

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        self.vocab_size = tasks.N_SPECIAL + cfg.n_symbols

    def loss(self, module: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
        logits = module(batch["src"], batch["tgt_in"])  # (B, L + 1, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["tgt_out"].flatten())
        return loss, batch["src"].numel() + batch["tgt_in"].numel()

    @torch.no_grad()
    def evaluate(self, module: nn.Module, batch_size: int = 64) -> dict[str, float]:
        model = _expect(module, EncoderDecoder)
        device = next(module.parameters()).device
        total, correct_tokens, exact, count = 0.0, 0, 0, 0
        with _eval_mode(module):
            for chunk in self.eval_chunks(batch_size, device):
                logits = module(chunk["src"], chunk["tgt_in"]).float()  # (b, L + 1, V)
                total += float(F.cross_entropy(logits.flatten(0, 1), chunk["tgt_out"].flatten(), reduction="sum"))
                decoded = greedy_decode(model, chunk["src"], chunk["tgt_out"].shape[1])  # (b, L + 1)
                hits = decoded == chunk["tgt_out"]
                correct_tokens += int(hits.sum())
                exact += int(hits.all(dim=1).sum())
                count += len(decoded)
        n_tokens = count * self.max_seq_len
        return {"loss": total / n_tokens, "token_accuracy": correct_tokens / n_tokens, "exact_match": exact / count}


def greedy_decode(model: EncoderDecoder, src: Tensor, length: int) -> Tensor:
    """Decode ``length`` tokens after BOS by always taking the most likely next token.

    Args:
        model: an ``EncoderDecoder``.
        src: (B, S) source ids.
        length: number of tokens to produce.

    Returns:
        (B, length) ids, BOS excluded.
    """
    memory = model.encode(src)  # (B, S, C)
    out = torch.full((src.shape[0], 1), tasks.BOS, dtype=torch.long, device=src.device)  # (B, 1)
    for _ in range(length):
        logits = model.decode(out, memory, last_only=True)  # (B, 1, V)
        out = torch.cat([out, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out[:, 1:]


def _expect(module: nn.Module, kind: type[M]) -> M:
    """``module`` as the model family of this task (the trainer checked the config's arch)."""
    if not isinstance(module, kind):
        raise ConfigError(f"this task trains a {kind.__name__}; got {type(module).__name__}")
    return module


class _eval_mode:
    """Switch a module to eval mode for a block and restore its previous mode after."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.was_training = module.training

    def __enter__(self) -> nn.Module:
        self.module.eval()
        return self.module

    def __exit__(self, *exc: object) -> None:
        self.module.train(self.was_training)


def make_objective(cfg: TrainConfig) -> Objective:
    """The objective for ``cfg.task``."""
    if cfg.task == "finetune":
        raise ConfigError("the finetune task needs its data and model; build it with oneblock.finetune.run")
    if cfg.task == "lm":
        return LanguageModeling(cfg)
    if cfg.task == "mlm":
        return MaskedLanguageModeling(cfg)
    if cfg.task == "majority":
        return Classification(cfg)
    return SequenceToSequence(cfg)
