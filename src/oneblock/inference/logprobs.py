"""Log-probabilities of tokens under the model's raw distribution: of each generated token, and of a prompt's own.

Shape notation: B batch, T prompt length, n generated tokens, N alternatives reported, V vocabulary.

What is reported is ``log_softmax`` of the model's logits in float32 (float64 for a float64 model), before
temperature, ``logit_bias``, penalties, filters or a grammar: the distribution the model itself assigns, as vLLM
and OpenAI report it, so that a score does not depend on how the text was sampled.

A prompt's log-probabilities (``prompt_logprobs``, OpenAI's ``echo``) come from one forward pass over the whole
prompt, position ``t`` predicting token ``t + 1``; the first token has none (OpenAI's ``null``). The sum over a
continuation is the loglikelihood that evaluation harnesses read (``loglikelihood``). For a GGUF model on the
default path, that pass runs every matrix through ``oneblock.kernels.block_mm`` with all T rows at once (the head
``SCORE_ROWS`` rows at a time, the remainder joining the last chunk, so no (T, V) tensor is made): from 32 rows up
(``GEMM_ROWS``) that is ``x @ dequantize(W).T`` in float32, the file's exact weights with float activations, so a
long prompt's scores are the float32 model's up to summation order; below 32 rows (and in every decoding step) the
activations are rounded to 8-bit blocks first, the kernels' stated bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from oneblock.errors import InputError
from oneblock.inference.spans import spans
from oneblock.models.decoder import Decoder
from oneblock.models.inputs import check_tokens

SCORE_ROWS = 256
"""Prompt positions whose logits a prompt's scoring computes at once: (256, V) float32 at most."""


@dataclass(frozen=True)
class TopLogprobs:
    """Chosen tokens' log-probabilities and the N most likely alternatives at each position.

    Attributes:
        chosen: (...,) the log-probability of each chosen token.
        top_ids: (..., N) int64 ids of the N most likely tokens, most likely first (N may be 0).
        top_values: (..., N) their log-probabilities.
    """

    chosen: Tensor
    top_ids: Tensor
    top_values: Tensor


def _check_top(top: object, vocab_size: int) -> int:
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= vocab_size:
        raise InputError(f"top must be an int in [0, {vocab_size}] (the vocabulary); got {top!r}")
    return top


def log_probs(logits: Tensor) -> Tensor:
    """``log_softmax`` over the last dimension, in float32 at least (float64 logits stay float64)."""
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


def token_logprobs(logits: Tensor, chosen: Tensor, top: int = 0) -> TopLogprobs:
    """The raw distribution's log-probability of ``chosen`` and its ``top`` most likely alternatives.

    Args:
        logits: (..., V) next-token logits, before any sampling setting.
        chosen: (...) int64 ids, one per row of ``logits``.
        top: N, alternatives to report per row (0 for none).

    Returns:
        ``chosen`` (...), ``top_ids`` and ``top_values`` (..., N).

    Raises:
        InputError: ``top`` outside ``[0, V]``, or ``chosen`` of another shape than ``logits[..., 0]``.
    """
    top = _check_top(top, logits.shape[-1])
    if tuple(chosen.shape) != tuple(logits.shape[:-1]):
        raise InputError(f"chosen must have shape {tuple(logits.shape[:-1])}; got {tuple(chosen.shape)}")
    lp = log_probs(logits)  # (..., V)
    picked = lp.gather(-1, chosen.to(device=lp.device, dtype=torch.long)[..., None])[..., 0]  # (...)
    values, ids = lp.topk(top, dim=-1)  # (..., N) each, most likely first
    return TopLogprobs(picked, ids, values)


class LogprobTrace:
    """Collects, while ``generate`` runs, each step's ``token_logprobs``: pass one as ``logprobs=``.

    After each step yielded by ``generate_stream`` the trace already holds that step, so a stream can report it
    at once. A row that has stopped (after its ``eos_id``) is recorded with its padding id; ignore those steps.

    Args:
        top: N, alternatives per token (0: the chosen tokens' only).

    >>> trace = LogprobTrace(top=5)
    >>> ids = generate(model, prompt, 10, logprobs=trace)  # doctest: +SKIP
    >>> trace.result().chosen.shape  # (B, n)  # doctest: +SKIP
    """

    def __init__(self, top: int = 0) -> None:
        if isinstance(top, bool) or not isinstance(top, int) or top < 0:
            raise InputError(f"top must be an int >= 0; got {top!r}")
        self.top = top
        self.steps: list[TopLogprobs] = []  # one per generated token, shapes (B,) and (B, N)

    def record(self, logits: Tensor, chosen: Tensor) -> TopLogprobs:
        """Add one step: ``logits`` (B, V) as the model returned them, ``chosen`` (B,) the ids kept."""
        step = token_logprobs(logits, chosen, self.top)
        self.steps.append(step)
        return step

    def result(self) -> TopLogprobs:
        """Every step stacked: ``chosen`` (B, n), ``top_ids`` and ``top_values`` (B, n, N)."""
        if not self.steps:
            raise InputError("the trace holds no step yet: nothing was generated with it")
        return TopLogprobs(
            torch.stack([s.chosen for s in self.steps], dim=1),
            torch.stack([s.top_ids for s in self.steps], dim=1),
            torch.stack([s.top_values for s in self.steps], dim=1),
        )


def _prompt_tensor(model: nn.Module, prompt_ids: Sequence[int] | Tensor) -> tuple[Decoder, Tensor]:
    if not isinstance(model, Decoder):
        raise InputError(f"prompt log-probabilities need a decoder-only model (a Decoder); got {type(model).__name__}")
    if isinstance(prompt_ids, Tensor):
        ids = prompt_ids
    else:
        if isinstance(prompt_ids, str) or any(isinstance(i, bool) or not isinstance(i, int) for i in prompt_ids):
            raise InputError(f"prompt_ids must be a sequence of int token ids; got {str(prompt_ids)[:60]}")
        ids = torch.tensor(list(prompt_ids), dtype=torch.long)
    if ids.dim() != 1 or ids.numel() == 0:
        raise InputError(f"prompt_ids must be one non-empty sequence of ids; got shape {tuple(ids.shape)}")
    check_tokens(ids[None], model.config, name="prompt_ids")
    return model, ids.to(device=model.embed.device, dtype=torch.long)


@torch.inference_mode()
def prompt_logprobs(model: nn.Module, prompt_ids: Sequence[int] | Tensor, top: int = 0) -> TopLogprobs:
    """Each prompt token's log-probability given the tokens before it, from one forward over the prompt.

    Args:
        model: a ``Decoder`` (run in eval mode; its mode is restored afterwards).
        prompt_ids: (T,) ids, T >= 1, within the model's context.
        top: N, alternatives per position.

    Returns:
        For tokens 1..T-1 (token 0 has none: OpenAI's ``null``): ``chosen`` (T - 1,), ``top_ids`` and
        ``top_values`` (T - 1, N), the alternatives at each of those positions.

    Raises:
        InputError: not a ``Decoder``, an empty prompt, ids out of range, a prompt longer than the context, or
            ``top`` outside ``[0, V]``.
    """
    decoder, ids = _prompt_tensor(model, prompt_ids)
    top = _check_top(top, decoder.config.vocab_size)
    was_training = decoder.training
    decoder.eval()
    try:
        hidden = decoder.run(ids[None])[0]  # (T, C)
        # the head SCORE_ROWS positions at a time (the remainder joining the last chunk): (SCORE_ROWS, V) at most
        parts = [
            token_logprobs(decoder.logits(hidden[a:b]), ids[a + 1 : b + 1], top)  # position t predicts t + 1
            for a, b in spans(0, ids.numel() - 1, SCORE_ROWS)
        ]
    finally:
        decoder.train(was_training)
    if not parts:  # one token: nothing before it to predict it from
        return token_logprobs(decoder.logits(hidden[:0]), ids[1:], top)
    fields = zip(*((p.chosen, p.top_ids, p.top_values) for p in parts), strict=True)
    return TopLogprobs(*(torch.cat(f) for f in fields))


def loglikelihood(model: nn.Module, context: Sequence[int], continuation: Sequence[int]) -> tuple[float, bool]:
    """``log p(continuation | context)`` and whether every continuation token is the model's argmax.

    The pair evaluation harnesses read for multiple-choice tasks (lm-eval's ``loglikelihood`` requests), from one
    forward over ``context + continuation``.

    Args:
        model: a ``Decoder``.
        context: the C >= 1 ids before the continuation.
        continuation: the K >= 1 ids scored.

    Returns:
        ``(sum of the K log-probabilities, is_greedy)``, the sum taken in float64.

    Raises:
        InputError: an empty context or continuation, or what ``prompt_logprobs`` refuses.
    """
    if len(context) == 0 or len(continuation) == 0:
        raise InputError(
            f"loglikelihood needs a non-empty context and continuation; got {len(context)} and {len(continuation)} "
            "ids (start the context with the BOS id when there is nothing else)"
        )
    scores = prompt_logprobs(model, [*context, *continuation], top=1)
    k = len(continuation)
    tail = scores.chosen[-k:]  # (K,)
    greedy = bool((scores.top_ids[-k:, 0] == torch.tensor(list(continuation), device=tail.device)).all())
    return float(tail.double().sum()), greedy
