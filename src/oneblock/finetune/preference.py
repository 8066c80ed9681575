"""Direct preference optimization (DPO; Rafailov et al., 2023) as an ``Objective`` of the trainer.

For a prompt x with a chosen answer y_w and a rejected one y_l, the policy pi and a frozen reference pi_ref::

    loss = -log sigmoid(beta * ((log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))))

with each log-probability summed over the answer's trained tokens (the answer and its end-of-turn token), the
sigmoid loss of trl's ``DPOTrainer``. The implicit rewards ``beta * (log pi - log pi_ref)`` of the two answers
give the reward margin (chosen minus rejected) and the reward accuracy (the share of pairs whose chosen answer
earns more) that the log reports each step.

The reference is the base model: for LoRA the same model with its adapters switched off
(``adapters_disabled``), so no second copy is held; for full fine-tuning a frozen copy taken before training.

A batch holds whole pairs on its first axis (the trainer cuts micro-batches along it): ``tokens`` and ``labels``
(B, 2, T), chosen then rejected, ``lengths`` (B, 2). Shape notation: B pairs, T length, V vocabulary.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from oneblock.adapters.apply import adapters_disabled, lora_modules
from oneblock.errors import ConfigError
from oneblock.finetune.batches import pad_batch
from oneblock.finetune.pairs import PairExample
from oneblock.layers.chunked_ce import per_row_gradients
from oneblock.train.config import TrainConfig
from oneblock.train.objectives import Objective, _eval_mode

DEFAULT_BETA = 0.1
# The loss's gradient is beta times that of the log-probabilities, and beta * margin saturates the sigmoid: past
# 1e3 (published runs use 0.01 to 0.5) a step is a hard step function of the margin whose gradients overflow
# float32 on the way down the model, and past float32's range (3.4e38) beta itself is inf and the first loss NaN.
MAX_BETA = 1e3


def pair_batch(pairs: Sequence[PairExample], *, pad_id: int) -> dict[str, Tensor]:
    """``tokens``, ``labels`` (B, 2, T) and ``lengths`` (B, 2): every answer's example right-padded to the longest."""
    flat = pad_batch([e for p in pairs for e in (p.chosen, p.rejected)], pad_id=pad_id)  # (2B, T), pairs adjacent
    return {k: v.unflatten(0, (len(pairs), 2)) for k, v in flat.items()}  # (B, 2, T) / (B, 2)


def sequence_logps(module: nn.Module, tokens: Tensor, labels: Tensor) -> Tensor:
    """(R,) summed log-probability of each row's trained labels; ``tokens``, ``labels`` (R, T).

    Each token's log-probability comes from the model's chunked cross-entropy (``targets=``): the (R, T, V)
    logits are never held whole. The rows' gradients differ (each sequence's weight in the loss is its own),
    so a trained head's backward pass computes its logits again (``per_row_gradients``).
    """
    with per_row_gradients():
        losses = module(tokens, targets=labels)  # (R, T) float32 -log p(label), 0 where IGNORE
    return -losses.sum(dim=1)


def check_beta(beta: object) -> float:
    """``beta`` as a float, or a ``ConfigError`` unless it lies in (0, ``MAX_BETA``]."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 < beta < float("inf"):
        raise ConfigError(f"beta must be a finite number > 0; got {beta!r}")
    if beta > MAX_BETA:
        raise ConfigError(
            f"beta must be at most {MAX_BETA:g}; got {beta:g}: larger values make DPO's loss a step function whose "
            "gradients overflow (0.01 to 0.5 is usual)"
        )
    return float(beta)


def dpo_loss(
    chosen: Tensor, rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, *, beta: float
) -> tuple[Tensor, Tensor, Tensor]:
    """DPO's sigmoid loss of B pairs, averaged, and each answer's implicit reward.

    Args:
        chosen, rejected: (B,) the policy's summed log-probabilities of the two answers.
        ref_chosen, ref_rejected: (B,) the reference's.
        beta: the strength of the pull toward the reference (higher: closer to it).

    Returns:
        ``(loss, chosen_rewards, rejected_rewards)``: the scalar mean loss and the (B,) rewards, detached.
    """
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    loss = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio)).mean()
    return loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


class PreferenceObjective(Objective):
    """DPO on tokenized preference pairs.

    Args:
        cfg: the training settings (``seq_len``, ``seed``).
        train: the training pairs.
        held_out: pairs scored by ``evaluate`` (may be empty).
        model: the model being trained, as it is now (before any step): with LoRA adapters its reference is
            itself with the adapters off; otherwise a frozen copy of it is kept as the reference.
        vocab_size: the model's vocabulary.
        pad_id: the id that fills padding.
        beta: DPO's beta (> 0).

    Raises:
        ConfigError: ``beta`` not a number in (0, ``MAX_BETA``].
    """

    arch = "decoder"

    def __init__(
        self,
        cfg: TrainConfig,
        train: Sequence[PairExample],
        held_out: Sequence[PairExample],
        *,
        model: nn.Module,
        vocab_size: int,
        pad_id: int,
        beta: float = DEFAULT_BETA,
    ) -> None:
        super().__init__(cfg)
        self.beta = check_beta(beta)
        self.vocab_size = vocab_size
        self.max_seq_len = self.seq_len
        self.train_pairs, self.held_out = list(train), list(held_out)
        self.pad_id = pad_id
        # LoRA: the base is the model with its adapters off. Full: a frozen copy, held apart from the trainer.
        self.reference: nn.Module | None = None
        if not lora_modules(model):
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.epoch, self.cursor = 0, 0
        self._order = self._epoch_order(0)
        self._sums = torch.zeros(4, dtype=torch.float64)  # this step's: pairs, margin, correct, loss * pairs

    def _epoch_order(self, epoch: int) -> list[int]:
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.train_pairs), generator=gen).tolist()

    def next_batch(self, n: int) -> dict[str, Tensor]:
        chosen: list[PairExample] = []
        while len(chosen) < n:
            if self.cursor == len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            chosen.append(self.train_pairs[self._order[self.cursor]])
            self.cursor += 1
        return pair_batch(chosen, pad_id=self.pad_id)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._epoch_order(self.epoch)

    def loss_weight(self, batch: dict[str, Tensor]) -> float:
        return float(batch["tokens"].shape[0])  # the loss is a mean over pairs

    def _reference_context(self, module: nn.Module) -> tuple[nn.Module, AbstractContextManager[Any]]:
        if self.reference is not None:
            return self.reference.to(next(module.parameters()).device), nullcontext()
        return module, adapters_disabled(module)

    def logps(self, module: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """(B, 2) summed log-probabilities of the chosen and rejected answers, under the policy (with gradients)
        and the reference (without)."""
        tokens, labels = batch["tokens"].flatten(0, 1), batch["labels"].flatten(0, 1)  # (2B, T), pairs adjacent
        policy = sequence_logps(module, tokens, labels).unflatten(0, (-1, 2))  # (B, 2)
        reference, switched = self._reference_context(module)
        with torch.no_grad(), switched:
            ref = sequence_logps(reference, tokens, labels).unflatten(0, (-1, 2))  # (B, 2)
        return policy, ref

    def loss(self, module: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
        policy, ref = self.logps(module, batch)
        loss, chosen_rewards, rejected_rewards = dpo_loss(
            policy[:, 0], policy[:, 1], ref[:, 0], ref[:, 1], beta=self.beta
        )
        margin = chosen_rewards - rejected_rewards  # (B,)
        b = margin.shape[0]
        self._sums += torch.tensor([b, float(margin.sum()), float((margin > 0).sum()), float(loss.detach()) * b],
                                   dtype=torch.float64)  # fmt: skip
        return loss, int(batch["lengths"].sum())

    def step_metrics(self) -> dict[str, float]:
        """This step's reward margin and reward accuracy (means over its pairs); resets the sums."""
        pairs, margin, correct, _ = self._sums.tolist()
        self._sums.zero_()
        if not pairs:
            return {}
        return {"reward_margin": margin / pairs, "reward_accuracy": correct / pairs}

    @torch.no_grad()
    def evaluate(self, module: nn.Module, batch_size: int = 8) -> dict[str, float]:
        """On the held-out pairs: the DPO loss, reward margin and accuracy, and the policy's own preference (the
        share of pairs it gives the chosen answer a higher log-probability, and the mean log-probability gap),
        which, unlike the rewards (zero before training), also says what the base model prefers."""
        if not self.held_out:
            return {}
        device = next(module.parameters()).device
        rows: list[Tensor] = []
        with _eval_mode(module):
            for i in range(0, len(self.held_out), batch_size):
                batch = pair_batch(self.held_out[i : i + batch_size], pad_id=self.pad_id)
                policy, ref = self.logps(module, {k: v.to(device) for k, v in batch.items()})
                rows.append(torch.cat([policy, ref], dim=1).double().cpu())  # (b, 4)
        scores = torch.cat(rows)  # (P, 4): chosen, rejected, ref chosen, ref rejected
        self._sums.zero_()  # evaluation is not part of a training step's figures
        return preference_scores(scores, beta=self.beta)


def preference_scores(scores: Tensor, *, beta: float) -> dict[str, float]:
    """The held-out figures of ``PreferenceObjective.evaluate`` from (P, 4) log-probabilities (chosen, rejected,
    reference chosen, reference rejected)."""
    loss, chosen_rewards, rejected_rewards = dpo_loss(*scores.unbind(1), beta=beta)
    margin = chosen_rewards - rejected_rewards
    gap = scores[:, 0] - scores[:, 1]
    return {
        "loss": float(loss),
        "reward_margin": float(margin.mean()),
        "reward_accuracy": float((margin > 0).double().mean()),
        "preference_accuracy": float((gap > 0).double().mean()),
        "logp_margin": float(gap.mean()),
    }
