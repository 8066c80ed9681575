"""Supervised fine-tuning as an ``Objective`` of the trainer: next-token cross-entropy on the trained tokens only.

The loss of a batch is the mean over its trained tokens, and ``loss_weight`` is their count, so the trainer
weighs every micro-batch by its share of the whole optimizer step's trained tokens: the gradient is the mean over
all trained tokens of the step, whatever the accumulation or the number of processes (an accumulated step equals
one big batch).

The stream visits the training examples (or, with packing, groups of them) epoch by epoch in an order drawn from
``(seed, epoch)`` alone, so ``(epoch, cursor)`` is its whole state and a resumed run reads the same batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from oneblock.finetune.batches import pack, packed_batch, pad_batch
from oneblock.finetune.tokenize import Example
from oneblock.layers.chunked_ce import predictions
from oneblock.train.config import TrainConfig
from oneblock.train.masking import IGNORE
from oneblock.train.objectives import Objective, _eval_mode

MODEL_INPUTS = ("positions", "segment_ids")  # batch entries passed to the model besides the tokens


class SupervisedObjective(Objective):
    """Next-token prediction on the trained tokens of tokenized examples.

    Args:
        cfg: the training settings (``seq_len``, ``seed``).
        train: the training examples.
        held_out: examples scored by ``evaluate`` (may be empty).
        vocab_size: the model's vocabulary.
        pad_id: the id that fills padding (never trained, never attended to).
        packed: several examples per row (block-diagonal attention, restarted positions).
    """

    arch = "decoder"

    def __init__(
        self,
        cfg: TrainConfig,
        train: Sequence[Example],
        held_out: Sequence[Example],
        *,
        vocab_size: int,
        pad_id: int,
        packed: bool = False,
    ) -> None:
        super().__init__(cfg)
        self.vocab_size = vocab_size
        self.max_seq_len = self.seq_len
        self.train_examples = list(train)
        self.held_out = list(held_out)
        self.pad_id = pad_id
        self.packed = packed
        self.epoch = 0
        self.cursor = 0
        self._items = self._epoch_items(0)

    def _epoch_items(self, epoch: int) -> list[list[Example]]:
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)
        order = [self.train_examples[i] for i in torch.randperm(len(self.train_examples), generator=gen).tolist()]
        return pack(order, self.seq_len) if self.packed else [[e] for e in order]

    def _batch(self, items: Sequence[Sequence[Example]]) -> dict[str, Tensor]:
        if self.packed:
            return packed_batch(items, seq_len=self.seq_len, pad_id=self.pad_id)
        return pad_batch([group[0] for group in items], pad_id=self.pad_id)

    def next_batch(self, n: int) -> dict[str, Tensor]:
        items: list[list[Example]] = []
        while len(items) < n:
            if self.cursor == len(self._items):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._items = self._epoch_items(self.epoch)
            items.append(self._items[self.cursor])
            self.cursor += 1
        return self._batch(items)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._items = self._epoch_items(self.epoch)

    def loss_weight(self, batch: dict[str, Tensor]) -> float:
        return float((batch["labels"] != IGNORE).sum())

    def loss(self, module: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
        total, count = self.loss_sum(module, batch)
        return total / max(count, 1), int(batch["lengths"].sum())

    def loss_sum(self, module: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
        """Summed cross-entropy over the trained tokens of a batch, and their number.

        The model computes each token's loss itself (``targets=``), the head a tile at a time, so the (B, T, V)
        logits are never held whole (``oneblock.layers.chunked_ce``).
        """
        extra = {k: batch[k] for k in MODEL_INPUTS if k in batch}
        labels = batch["labels"]  # (B, T)
        losses = module(batch["tokens"], targets=labels, **extra)  # (B, T) float32, 0 where IGNORE
        return losses.sum(), int((labels != IGNORE).sum())

    @torch.no_grad()
    def evaluate(self, module: nn.Module, batch_size: int = 8) -> dict[str, float]:
        """The held-out examples' loss (nats per trained token) and next-token accuracy (the label is the most
        likely word), a batch at a time, the head's logits a tile at a time (never (b, T, V) whole)."""
        if not self.held_out:
            return {}
        device = next(module.parameters()).device
        total, correct, count = 0.0, 0, 0
        with _eval_mode(module):
            for i in range(0, len(self.held_out), batch_size):
                batch = pad_batch(self.held_out[i : i + batch_size], pad_id=self.pad_id)
                tokens, labels = batch["tokens"].to(device), batch["labels"].to(device)
                with predictions() as found:
                    losses = module(tokens, targets=labels)  # (b, T), 0 where IGNORE
                chosen = labels != IGNORE
                total += float(losses[chosen].double().sum())
                correct += int((found[-1].view(labels.shape)[chosen] == labels[chosen]).sum())
                count += int(chosen.sum())
        return {"loss": total / count, "accuracy": correct / count}
