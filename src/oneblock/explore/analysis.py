"""The explorer's figures for one input, all from one forward pass of a oneblock model, as JSON-able dicts.

* the attention weights the model returns with ``return_attention=True``, grouped by kind (``self`` for one
  stack; ``encoder``, ``decoder``, ``cross`` for an encoder-decoder), packed as float32;
* the residual stream after the embeddings and after every block, caught by forward hooks on the blocks, and
  the logit lens: the final norm and the LM head applied to each of them;
* the next-token logits at the last position, the top-k of softmax(logits / temperature), and one generation
  step (greedy, or sampled with a seeded generator).

Tensors travel as ``{"shape", "dtype": "float32", "b64"}``: little-endian float32 bytes in base64, so the page
reads exactly the numbers computed here.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from oneblock.errors import InputError
from oneblock.explore.diagram import block_diagram
from oneblock.explore.loading import Explorable
from oneblock.explore.requests import Request
from oneblock.models.inputs import config_of

LENS_CHUNK = 8  # layers per head product in the logit lens: bounds memory at LENS_CHUNK x T x V floats


def pack(tensor: Tensor) -> dict[str, Any]:
    """A tensor as base64 float32 (little-endian), with its shape."""
    array = tensor.detach().to(torch.float32).contiguous().cpu().numpy().astype("<f4")
    return {"shape": list(tensor.shape), "dtype": "float32", "b64": base64.b64encode(array.tobytes()).decode()}


def unpack(packed: dict[str, Any]) -> Tensor:
    """The inverse of ``pack``."""
    import numpy as np

    array = np.frombuffer(base64.b64decode(packed["b64"]), dtype="<f4").reshape(packed["shape"])
    return torch.from_numpy(array.copy())


def is_seq2seq(model: nn.Module) -> bool:
    return config_of(model).arch == "encoder-decoder"


def forward_with_attention(model: nn.Module, ids: Tensor, target: Tensor | None) -> tuple[Tensor, dict[str, list]]:
    """``model(..., return_attention=True)``, with the weights as named groups of (B, H, T, S) tensors.

    Args:
        ids: (B, T) ids of the first stack (the source of an encoder-decoder).
        target: (B, T_tgt) decoder ids of an encoder-decoder, else ``None``.

    Returns:
        ``(out, groups)``: logits (B, T, V) or an encoder's hidden states (B, T, C); ``{"self": [...]}`` for one
        stack, ``{"encoder", "decoder", "cross"}`` for an encoder-decoder, one tensor per block in each.
    """
    inputs = (ids,) if target is None else (ids, target)
    out, weights = model(*inputs, return_attention=True)
    if isinstance(weights, dict):
        return out, {name: list(weights[name]) for name in ("encoder", "decoder", "cross") if name in weights}
    return out, {"self": list(weights)}


def lens_stack(model: nn.Module) -> Any:
    """The stack whose residual stream the lens reads (a ``Decoder`` or ``Encoder``, with ``blocks`` and
    ``final_norm``): the model itself, or an encoder-decoder's decoder."""
    return model.decoder if is_seq2seq(model) else model


def lens_head(model: nn.Module) -> Callable[[Tensor], Tensor] | None:
    """Hidden states (..., C) -> logits (..., V) as the model's top does it: final norm (pre-LN), then the head.

    ``None`` for an encoder, which has no LM head.
    """
    if config_of(model).arch == "encoder":
        return None
    decoder = lens_stack(model)
    norm = decoder.final_norm

    def head(hidden: Tensor) -> Tensor:
        return decoder.logits(norm(hidden) if norm is not None else hidden)

    return head


@contextmanager
def residual_stream(stack: Any) -> Iterator[list[Tensor]]:
    """Record the stream entering the first block and leaving every block, (B, T, C) each, L + 1 in all."""
    captured: list[Tensor] = []

    def first(module: nn.Module, args: tuple, kwargs: dict) -> None:
        captured.append((args[0] if args else kwargs["x"]).detach())

    def after(module: nn.Module, args: tuple, out: Any) -> None:
        captured.append((out[0] if isinstance(out, tuple) else out).detach())

    handles = [stack.blocks[0].register_forward_pre_hook(first, with_kwargs=True)]
    handles += [block.register_forward_hook(after) for block in stack.blocks]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def tempered_top(logits: Tensor, temperature: float, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` most likely ids of softmax(logits / temperature) over the whole vocabulary, and their probabilities.

    Args:
        logits: (V,).

    Returns:
        ``(ids, probs)``, (k,) each, most likely first. The order does not depend on the temperature.
    """
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    top = torch.topk(probs, min(k, probs.numel()))
    return top.indices, top.values


def _tokens(explorable: Explorable, ids: list[int]) -> list[dict[str, Any]]:
    return [{"id": i, "piece": explorable.codec.piece(i)} for i in ids]


def _attention(groups: dict[str, list[Tensor]]) -> list[dict[str, Any]]:
    labels = {
        "self": "self-attention",
        "encoder": "encoder self-attention",
        "decoder": "decoder self-attention (causal)",
        "cross": "cross-attention (decoder x source)",
    }
    rows_cols = {"self": ("tokens", "tokens"), "encoder": ("source", "source"), "decoder": ("target", "target")}
    out = []
    for name, weights in groups.items():
        stacked = torch.cat([w[:1] for w in weights])  # (L, H, T, S) of the first (only) batch row
        rows, cols = rows_cols.get(name, ("target", "source"))
        out.append({"name": name, "label": labels[name], "rows": rows, "cols": cols, "weights": pack(stacked)})
    return out


def _lens(explorable: Explorable, stream: list[Tensor]) -> dict[str, Any]:
    """For every layer, each position's top-1 token under the lens and the L2 norm of the stream."""
    hidden = torch.cat([h[:1] for h in stream])  # (L + 1, T, C)
    norms = hidden.float().norm(dim=-1)  # (L + 1, T)
    head = lens_head(explorable.model)
    layers = ["embeddings"] + [f"block {i}" for i in range(1, len(stream))]
    result: dict[str, Any] = {"layers": layers, "residual_norm": norms.tolist(), "predictions": None}
    if head is None:
        return result
    top_ids, top_probs = [], []
    for start in range(0, hidden.shape[0], LENS_CHUNK):
        logits = head(hidden[start : start + LENS_CHUNK]).float()  # (chunk, T, V)
        best, best_id = logits.max(dim=-1)  # (chunk, T)
        # The top probability of softmax(logits) is 1 / sum_j exp(l_j - max), computed in place: no second (T, V).
        top_probs.append(logits.sub_(best[..., None]).exp_().sum(dim=-1).reciprocal())
        top_ids.append(best_id)
    ids, probs = torch.cat(top_ids), torch.cat(top_probs)  # (L + 1, T)
    piece = explorable.codec.piece
    result["predictions"] = [
        [{"id": i, "piece": piece(i), "prob": p} for i, p in zip(row_i, row_p, strict=True)]
        for row_i, row_p in zip(ids.tolist(), probs.tolist(), strict=True)
    ]
    return result


def _next_token(explorable: Explorable, logits: Tensor, request: Request) -> dict[str, Any]:
    ids, probs = tempered_top(logits, request.temperature, request.top_k)
    return {
        "temperature": request.temperature,
        "top": [
            {"id": int(i), "piece": explorable.codec.piece(int(i)), "logit": float(logits[i]), "prob": float(p)}
            for i, p in zip(ids.tolist(), probs.tolist(), strict=True)
        ],
        "logits": pack(logits),  # all V, so the page can redo softmax(logits / T) exactly
    }


def analyze(explorable: Explorable, request: Request) -> dict[str, Any]:
    """Every per-input view of the page for one checked request.

    Returns:
        ``tokens`` (and ``target_tokens`` for an encoder-decoder) with ids and pieces, ``text``, ``block`` (the
        diagram with live shapes), ``attention`` (groups of (L, H, T, S) weights), ``lens`` and ``next_token``
        (``None`` for an encoder).
    """
    model = explorable.model
    ids = torch.tensor([request.ids])  # (1, T)
    target = torch.tensor([request.target]) if request.target is not None else None
    with torch.inference_mode(), residual_stream(lens_stack(model)) as stream:
        out, groups = forward_with_attention(model, ids, target)
    last = request.target if request.target is not None else request.ids
    result: dict[str, Any] = {
        "text": explorable.codec.decode(request.ids),
        "tokens": _tokens(explorable, request.ids),
        "block": block_diagram(explorable.config, len(last), len(request.ids) if target is not None else None),
        "attention": _attention(groups),
        "lens": _lens(explorable, stream),
        "next_token": None if explorable.config.arch == "encoder" else _next_token(explorable, out[0, -1], request),
    }
    if request.target is not None:
        result["target_text"] = explorable.codec.decode(request.target)
        result["target_tokens"] = _tokens(explorable, request.target)
    return result


def next_id(explorable: Explorable, request: Request) -> int:
    """The token a generation step appends: argmax when ``greedy``, else a draw from softmax(logits / T) seeded
    with ``request.seed``."""
    from oneblock.inference.sampling import sample_next

    model = explorable.model
    with torch.inference_mode():
        if request.target is not None:
            logits = model(torch.tensor([request.ids]), torch.tensor([request.target]))
        else:
            logits = model(torch.tensor([request.ids]))
    generator = torch.Generator().manual_seed(request.seed)
    chosen = sample_next(
        logits[:, -1], temperature=request.temperature, greedy=request.greedy, generator=generator
    )  # (1,)
    return int(chosen[0])


def generate_step(explorable: Explorable, request: Request, cap: int) -> dict[str, Any]:
    """Append one token to the decoder's sequence and analyse the result.

    Raises:
        InputError: the model is an encoder (no LM head), or the sequence already holds ``cap`` tokens.
    """
    if explorable.config.arch == "encoder":
        raise InputError("an encoder has no LM head, so there is no next token to generate")
    sequence = request.target if request.target is not None else request.ids
    if len(sequence) >= cap:
        raise InputError(f"the sequence already has {len(sequence)} tokens, the limit; shorten it to generate")
    token = next_id(explorable, request)
    longer = [*sequence, token]
    extended = replace(request, target=longer) if request.target is not None else replace(request, ids=longer)
    appended = {"id": token, "piece": explorable.codec.piece(token), "greedy": request.greedy, "seed": request.seed}
    return {"appended": appended, "analysis": analyze(explorable, extended)}
