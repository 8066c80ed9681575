"""Cross-entropy of an LM head computed in tiles: the (N, V) logits are never held whole.

For N rows of hidden states ``h`` (N, C), a head ``z = h W^T + b`` (N, V) and targets ``y`` (N,), the loss of row
i is ``logsumexp(z_i) - z_i[y_i]``. With V = 49,152 (SmolLM2) and N = 1,024 rows the logits alone are 201 MB of
float32, and autograd keeps them, their softmax and the gradient beside them. Here both passes walk the logits a
tile at a time: up to ``ROW_CHUNK`` rows against a slice of the vocabulary, at most ``CHUNK_VALUES`` logits and
``WEIGHT_TILE_VALUES`` weights.

* forward: per tile, the logits, their running maximum and sum of exponentials (an online softmax across the
  vocabulary's slices) and the target's logit; each row's logsumexp is kept (N floats). With a frozen head
  (LoRA's base, a 4-bit head) the same pass also gathers each row's gradient with respect to its hidden state,
  ``softmax(z_i) W - W[y_i]`` (N x C floats), and the backward pass only scales it by the row's incoming gradient.
* a trained head whose rows all get one incoming gradient (a sum or a mean of the losses: every training
  objective but a per-sequence one): the forward pass takes whole rows of logits, a chunk of rows at a time,
  and computes both gradients for an incoming gradient of 1 as it goes, ``g = softmax(z) - onehot(y)``,
  ``grad_h = g W`` and ``grad_W += g^T h``; the backward pass checks that the incoming gradient is one number
  and scales them by it. That is three products with the head, as ``F.cross_entropy`` over the whole logits
  takes, and keeps a (V, C) gradient from one pass to the other instead of the (N, V) logits.
* backward, for a trained head otherwise (incoming gradients that differ by row, or whole rows of logits over
  ``chunk_values``; :func:`per_row_gradients` skips the eager pass): per tile, the logits again, then
  ``g = (softmax(z) - onehot(y)) * grad`` (the softmax from the kept logsumexp), ``grad_h += g W_tile`` and
  ``grad_W[tile] += g^T h``.

Slicing the vocabulary rather than the rows means each tile of ``W`` is read once per pass, whatever N: a 4-bit
head (``BlockLinear``) dequantizes each slice once per step (frozen, the gradient gathered on the way), no more
than its own block product and backward do, and never holds the float matrix whole. Rows whose target is
``ignore_index`` are skipped in both passes: their loss and gradients are zero, as ``F.cross_entropy`` has them.

Shape notation: N rows, C width, V vocabulary, m rows and v vocabulary entries of a tile.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

from oneblock.errors import InputError

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index
CHUNK_VALUES = 1 << 25  # logits computed at once: 128 MB of float32
ROW_CHUNK = 8192  # rows at once, so that a tile spans at least CHUNK_VALUES / ROW_CHUNK = 1,024 words
WEIGHT_TILE_VALUES = 1 << 21  # weights of a tile at once: 8 MB of float32 (3,640 words of width 576)
REDUCTIONS = ("none", "sum", "mean")

_per_row: ContextVar[bool] = ContextVar("oneblock_ce_per_row_gradients", default=False)
_predicted: ContextVar[list[Tensor] | None] = ContextVar("oneblock_ce_predictions", default=None)


@contextmanager
def per_row_gradients() -> Iterator[None]:
    """Within, a trained head's losses expect incoming gradients that differ by row (a per-sequence objective such
    as DPO's): the forward pass keeps only the logsumexp and the backward pass computes the logits again, rather
    than gathering gradients for one incoming number that the backward pass would then find unusable."""
    token = _per_row.set(True)
    try:
        yield
    finally:
        _per_row.reset(token)


@contextmanager
def predictions() -> Iterator[list[Tensor]]:
    """Within, each call of :func:`chunked_cross_entropy` also appends to the list it yields every row's most
    likely word, ``argmax(z_i)`` (N,) int64 (the first of equal maxima, as ``torch.argmax`` picks; -1 at ignored
    rows), found tile by tile as the loss is: a held-out pass's accuracy without its (N, V) logits. The pass
    takes the tiles (no trained head's one-pass gradients), so its numbers are those of any other call."""
    found: list[Tensor] = []
    token = _predicted.set(found)
    try:
        yield found
    finally:
        _predicted.reset(token)


@runtime_checkable
class WeightRows(Protocol):
    """A head whose (V, C) weight is handed out a slice of rows at a time (``BlockLinear``: 4-bit blocks)."""

    out_features: int
    in_features: int

    def weight_rows(self, start: int, stop: int) -> Tensor:
        """Rows ``[start, stop)`` of the weight as a float (stop - start, C) tensor."""
        ...


def chunked_cross_entropy(
    hidden: Tensor,
    targets: Tensor,
    weight: Tensor | WeightRows,
    bias: Tensor | None = None,
    *,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "none",
    chunk_values: int = CHUNK_VALUES,
) -> Tensor:
    """``F.cross_entropy(F.linear(hidden, W, bias), targets, ignore_index=..., reduction=...)``, tile by tile.

    Args:
        hidden: (N, C) float hidden states (the head's input).
        targets: (N,) integer target ids in ``[0, V)``, or ``ignore_index`` where a row has no loss.
        weight: the head's (V, C) weight: a tensor (its gradient is computed when it requires one: a trained,
            possibly tied, head), or a ``WeightRows`` layer (a frozen 4-bit head).
        bias: (V,) added to the logits (not trained), or None.
        ignore_index: the target of rows without loss.
        reduction: ``none``: (N,) per-row losses, 0 at ignored rows; ``sum``; or ``mean`` over the rows that
            are not ignored (NaN when every row is, as ``F.cross_entropy``). Float32 (float64 for float64
            ``hidden``); under autocast the logits come in its dtype and the softmax is taken in float32.
        chunk_values: logits computed at once.

    Returns:
        the losses, reduced as asked.

    Raises:
        InputError: shapes that do not match, non-integer targets, a target outside ``[0, V)`` that is not
            ``ignore_index``, an unknown reduction or a non-positive ``chunk_values``.
    """
    if reduction not in REDUCTIONS:
        raise InputError(f"reduction must be one of {', '.join(REDUCTIONS)}; got {reduction!r}")
    vocab, width = weight.shape if isinstance(weight, Tensor) else (weight.out_features, weight.in_features)
    if hidden.dim() != 2 or hidden.shape[1] != width or targets.shape != (hidden.shape[0],):
        raise InputError(
            f"chunked_cross_entropy needs hidden (N, {width}) and targets (N,) for a ({vocab}, {width}) head; got "
            f"{tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (vocab,):
        raise InputError(f"bias must have shape ({vocab},); got {tuple(bias.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise InputError(f"targets must be integer ids (int64); got {targets.dtype}")
    outside = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if bool(outside.any()):
        raise InputError(
            f"target id {int(targets[outside][0])} is outside the vocabulary [0, {vocab}) and is not ignore_index "
            f"({ignore_index}); give ids of the head's vocabulary"
        )
    if isinstance(chunk_values, bool) or not isinstance(chunk_values, int) or chunk_values < 1:
        raise InputError(f"chunk_values must be a positive integer; got {chunk_values!r}")
    tensor = weight if isinstance(weight, Tensor) else None
    source = None if isinstance(weight, Tensor) else weight
    kept = (targets != ignore_index).nonzero().squeeze(1)  # (M,) rows with a loss
    # A frozen head under autograd: the hidden states' gradient is gathered in the forward pass (see below).
    trained = tensor is not None and tensor.requires_grad
    eager = torch.is_grad_enabled() and hidden.requires_grad and not trained
    # A trained head under autograd: both gradients for one incoming number, when whole rows fit a chunk.
    found = _predicted.get()
    uniform = torch.is_grad_enabled() and trained and not _per_row.get() and vocab <= chunk_values and found is None
    losses = _ChunkedCrossEntropy.apply(
        hidden, targets.long(), kept, tensor, source, bias, chunk_values, eager, uniform, found
    )
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":
        return losses.sum() / kept.shape[0]
    return losses


def _softmax_dtype(hidden: Tensor) -> torch.dtype:
    """The softmax's dtype: float64 for float64 hidden states, float32 otherwise (bfloat16 under autocast too)."""
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def _tiles(n_rows: int, vocab: int, width: int, chunk_values: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """``(row start, row stop, [(word start, word stop), ...])``: chunks of rows, each across the vocabulary."""
    rows = min(max(n_rows, 1), ROW_CHUNK)
    slices = _word_slices(vocab, width, max(1, chunk_values // rows))
    return [(r0, min(r0 + rows, n_rows), slices) for r0 in range(0, n_rows, rows)]


def _word_slices(vocab: int, width: int, most: int) -> list[tuple[int, int]]:
    """``[(word start, word stop), ...]`` across the vocabulary: at most ``most`` words, and a weight tile, each."""
    words = min(vocab, most, max(1, WEIGHT_TILE_VALUES // max(width, 1)))
    return [(v0, min(v0 + words, vocab)) for v0 in range(0, vocab, words)]


class _ChunkedCrossEntropy(torch.autograd.Function):
    """(N,) per-row losses; keeps the hidden states, the targets and each kept row's logsumexp.

    A frozen head (no weight gradient asked for) needs no second pass over the logits: the gradient of row i's
    loss with respect to its hidden state is ``softmax(z_i) W - W[y_i]``, which the forward pass gathers as it
    goes (an online softmax: the sum of ``exp(z - max) W`` rescaled whenever a tile raises the row's maximum) and
    keeps, (M, C); the backward pass scales each row by its incoming gradient. A trained head's gradient
    ``sum_i grad_i (softmax(z_i) - onehot(y_i))^T h_i`` depends on the incoming gradients, so then the backward
    pass computes each tile's logits again.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        targets: Tensor,
        kept: Tensor,
        weight: Tensor | None,
        source: WeightRows | None,
        bias: Tensor | None,
        chunk_values: int,
        eager: bool,
        uniform: bool,
        found: list[Tensor] | None,
    ) -> Tensor:
        dtype = _softmax_dtype(hidden)
        head = _Head(weight, source, bias)
        ctx.uniform = None
        grad_rows: Tensor | None = None
        if uniform and weight is not None:
            lse, target_logit, ctx.uniform = _trained_head_pass(hidden, targets, kept, weight, bias, chunk_values)
        else:
            lse, target_logit, grad_rows, best = _tiled_pass(
                hidden, targets, kept, head, chunk_values, eager, found is not None
            )
            if found is not None and best is not None:
                predicted = torch.full_like(targets, -1)  # (N,)
                predicted[kept] = best
                found.append(predicted)
        losses = hidden.new_zeros(hidden.shape[0], dtype=dtype)  # (N,)
        losses[kept] = lse - target_logit
        head.weight = None  # the saved tensors hold it until the backward pass
        ctx.head, ctx.chunk_values = head, chunk_values
        device = hidden.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(hidden, targets, kept, lse, weight, grad_rows)
        return losses

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        hidden, targets, kept, lse, weight, grad_rows = ctx.saved_tensors
        none = (None,) * 6  # source, bias, chunk_values, eager, uniform, found
        if grad_rows is not None:  # a frozen head: the forward pass gathered d loss_i / d h_i
            gathered = torch.zeros_like(hidden)
            gathered[kept] = (grad_rows * grad[kept, None].to(grad_rows.dtype)).to(hidden.dtype)
            return gathered, None, None, None, *none
        eager, ctx.uniform = ctx.uniform, None  # used once: a second backward pass computes the logits again
        incoming = grad[kept]  # (M,)
        if eager is not None and (kept.numel() == 0 or bool((incoming == incoming[0]).all())):
            eager_rows, eager_weight = eager
            scale = incoming[0] if kept.numel() else grad.new_zeros(())
            grad_in = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
            if grad_in is not None:
                grad_in[kept] = (eager_rows * scale.to(eager_rows.dtype)).to(hidden.dtype)
            scaled = eager_weight.mul_(scale.to(eager_weight.dtype)) if ctx.needs_input_grad[3] else None
            return grad_in, None, None, scaled, *none
        head: _Head = ctx.head
        head.weight = weight
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if weight is not None and ctx.needs_input_grad[3] else None
        device, enabled, dtype = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            for r0, r1, slices in _tiles(kept.shape[0], head.vocab, hidden.shape[1], ctx.chunk_values):
                rows, y = kept[r0:r1], targets[kept[r0:r1]]  # (m,)
                h = hidden[rows]  # (m, C)
                for v0, v1 in slices:
                    tile = head.tile(v0, v1, h.dtype)  # (v, C)
                    # d loss_i / d z_i = softmax(z_i) - onehot(y_i), times row i's incoming gradient
                    g = head.logits(h, v0, v1, tile).to(lse.dtype).sub_(lse[r0:r1, None]).exp_()  # (m, v)
                    here = ((y >= v0) & (y < v1)).nonzero().squeeze(1)
                    g[here, y[here] - v0] -= 1.0
                    g.mul_(grad[rows, None].to(g.dtype))
                    if grad_hidden is not None:
                        grad_hidden.index_add_(0, rows, (g.to(tile.dtype) @ tile).to(hidden.dtype))  # (m, C)
                    if grad_weight is not None:
                        grad_weight[v0:v1] += (g.to(h.dtype).T @ h).to(weight.dtype)  # (v, C)
        head.weight = None
        return grad_hidden, None, None, grad_weight, *none


def _tiled_pass(
    hidden: Tensor, targets: Tensor, kept: Tensor, head: _Head, chunk_values: int, eager: bool, argmax: bool = False
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """The tiles' forward pass: each kept row's logsumexp and target logit (an online softmax across the
    vocabulary's slices), with ``eager`` (a frozen head) its gradient ``softmax(z) W - W[y]``, with ``argmax``
    its most likely word (a later slice takes over only with a strictly larger maximum: the first of equals).

    Returns:
        ``(lse, target_logit, grad_rows, best)``: (M,), (M,), (M, C) or None, (M,) int64 or None.
    """
    dtype = _softmax_dtype(hidden)
    m_rows = kept.shape[0]
    lse = hidden.new_empty(m_rows, dtype=dtype)  # (M,)
    target_logit = hidden.new_zeros(m_rows, dtype=dtype)  # (M,)
    grad_rows = hidden.new_empty(m_rows, hidden.shape[1], dtype=dtype) if eager else None  # (M, C)
    best = torch.zeros(m_rows, dtype=torch.int64, device=hidden.device) if argmax else None  # (M,)
    for r0, r1, slices in _tiles(m_rows, head.vocab, hidden.shape[1], chunk_values):
        rows, y = kept[r0:r1], targets[kept[r0:r1]]  # (m,)
        h = hidden[rows]  # (m, C)
        top = hidden.new_full((len(rows),), -torch.inf, dtype=dtype)  # (m,) the running maximum
        total = hidden.new_zeros(len(rows), dtype=dtype)  # (m,) sum of exp(z - top)
        mixed = hidden.new_zeros(len(rows), hidden.shape[1], dtype=dtype) if eager else None  # (m, C)
        target_rows = torch.zeros_like(mixed) if mixed is not None else None  # (m, C)
        for v0, v1 in slices:
            tile = head.tile(v0, v1, h.dtype)  # (v, C)
            logits = head.logits(h, v0, v1, tile).to(dtype)  # (m, v)
            if best is None:
                new_top = torch.maximum(top, logits.amax(dim=-1))
            else:
                tile_top, tile_best = logits.max(dim=-1)  # (m,) the first index of the slice's maximum
                best[r0:r1] = torch.where(tile_top > top, tile_best + v0, best[r0:r1])
                new_top = torch.maximum(top, tile_top)
            rescale = torch.exp(top - new_top)  # 0 at the first slice
            here = ((y >= v0) & (y < v1)).nonzero().squeeze(1)  # rows whose target lies in this slice
            target_logit[r0 + here] = logits[here, y[here] - v0]
            weights = logits.sub_(new_top[:, None]).exp_()  # (m, v), in the logits' own fresh buffer
            total = total * rescale + weights.sum(dim=-1)
            if mixed is not None and target_rows is not None:
                mixed = mixed * rescale[:, None] + (weights.to(tile.dtype) @ tile).to(dtype)  # (m, C)
                target_rows[here] = tile[y[here] - v0].to(dtype)  # W[y_i]
            top = new_top
            del logits, weights
        lse[r0:r1] = top + torch.log(total)
        if grad_rows is not None and mixed is not None and target_rows is not None:
            grad_rows[r0:r1] = mixed / total[:, None] - target_rows  # softmax(z_i) W - W[y_i]
    return lse, target_logit, grad_rows, best


def _trained_head_pass(
    hidden: Tensor, targets: Tensor, kept: Tensor, weight: Tensor, bias: Tensor | None, chunk_values: int
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """A trained head's forward pass with both gradients for an incoming gradient of 1 on every row.

    A chunk of rows at a time (as many as ``chunk_values`` logits hold), the chunk's logits tile by tile across
    the vocabulary, all kept: their maximum and target logits, then ``e = exp(z - max)`` in place and its sum
    ``s``, so that ``softmax(z) = e / s``. With ``g = softmax(z) - onehot(y)``: ``g W = (e W) / s - W[y]`` (m, C)
    and ``g^T h = e^T (h / s) - onehot(y)^T h`` (V, C), one product each per tile.

    Returns:
        ``(lse, target_logit, (grad_rows, grad_weight))``: (M,), (M,), (M, C) and (V, C).
    """
    dtype = _softmax_dtype(hidden)
    m_rows, vocab, width = kept.shape[0], weight.shape[0], hidden.shape[1]
    w = weight.detach().to(hidden.dtype)  # (V, C)
    head = _Head(w, None, bias)  # the logits as the other passes compute them (the bias after the product)
    lse = hidden.new_empty(m_rows, dtype=dtype)  # (M,)
    target_logit = hidden.new_empty(m_rows, dtype=dtype)  # (M,)
    grad_rows = hidden.new_zeros(m_rows, width, dtype=dtype)  # (M, C)
    grad_weight = torch.zeros_like(weight)  # (V, C)
    chunks = max(1, -(-m_rows // max(1, chunk_values // vocab)))
    rows_at_once = max(1, -(-m_rows // chunks))  # chunks of equal size
    slices = _word_slices(vocab, width, vocab)  # the vocabulary in weight tiles
    device = hidden.device.type
    in_place = not torch.is_autocast_enabled(device) and w.dtype == dtype == weight.dtype
    for r0 in range(0, m_rows, rows_at_once):
        r1 = min(r0 + rows_at_once, m_rows)
        rows, y = kept[r0:r1], targets[kept[r0:r1]]  # (m,)
        h = hidden[rows].detach()  # (m, C)
        top = h.new_full((len(rows),), -torch.inf, dtype=dtype)  # (m,)
        logits = []
        for v0, v1 in slices:
            z = head.logits(h, v0, v1, w[v0:v1]).to(dtype)  # (m, v), kept until the chunk is done
            here = ((y >= v0) & (y < v1)).nonzero().squeeze(1)
            target_logit[r0 + here] = z[here, y[here] - v0]
            top = torch.maximum(top, z.amax(dim=-1))
            logits.append(z)
        total = sum(z.sub_(top[:, None]).exp_().sum(dim=-1) for z in logits)  # (m,)
        assert isinstance(total, Tensor)
        lse[r0:r1] = top + torch.log(total)
        scaled = h / total[:, None].to(h.dtype)  # (m, C) h / s
        mixed = grad_rows[r0:r1]  # (m, C) the sum of e W over the tiles
        for (v0, v1), e in zip(slices, logits, strict=True):
            if in_place:  # the products added where they land, no (m, C) or (v, C) temporary
                mixed.addmm_(e, w[v0:v1])
                grad_weight[v0:v1].addmm_(e.T, scaled)
            else:  # autocast's products (bfloat16), or mixed dtypes
                mixed += (e.to(w.dtype) @ w[v0:v1]).to(dtype)
                grad_weight[v0:v1] += (e.to(h.dtype).T @ scaled).to(weight.dtype)
        mixed.div_(total[:, None]).sub_(w[y].to(dtype))  # softmax(z) W - W[y]
        grad_weight.index_add_(0, y, h.to(weight.dtype), alpha=-1)  # - onehot(y)^T h
        del logits
    return lse, target_logit, (grad_rows, grad_weight)


class _Head:
    """The head's logits over a slice of the vocabulary, from a weight tensor or a ``WeightRows`` layer."""

    def __init__(self, weight: Tensor | None, source: WeightRows | None, bias: Tensor | None) -> None:
        self.weight, self.source, self.bias = weight, source, bias
        self.vocab = weight.shape[0] if weight is not None else source.out_features  # type: ignore[union-attr]

    def tile(self, v0: int, v1: int, dtype: torch.dtype) -> Tensor:
        """Rows ``[v0, v1)`` of the weight, (v, C), in ``dtype`` (a view of a float weight; decoded blocks)."""
        rows = self.weight[v0:v1] if self.weight is not None else self.source.weight_rows(v0, v1)  # type: ignore[union-attr]
        return rows.detach().to(dtype)

    def logits(self, h: Tensor, v0: int, v1: int, tile: Tensor | None = None) -> Tensor:
        """(m, v) logits of the rows ``h`` (m, C) for the words ``[v0, v1)``."""
        z = F.linear(h, self.tile(v0, v1, h.dtype) if tile is None else tile)
        return z if self.bias is None else z + self.bias[v0:v1]
