"""One generation's request, validated once before the first forward pass: the prompt (padded, cropped to the
context), its mask over prompt and new tokens, and the model that reads it.

Shape notation: B batch, T prompt length, T' the part of it the model reads, N new tokens, S source length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from oneblock.errors import InputError
from oneblock.models.decoder import Decoder
from oneblock.models.encoder_decoder import EncoderDecoder
from oneblock.models.inputs import check_tokens

if TYPE_CHECKING:
    from typing_extensions import TypeIs

Prompt = Tensor | Sequence[int] | Sequence[Sequence[int] | Tensor]


@dataclass
class DecodeRequest:
    """Everything one generation needs, validated once, before the first forward pass."""

    model: Decoder | EncoderDecoder
    decoder: Decoder
    prompt: Tensor  # (B, T), the whole prompt as given
    seen: Tensor  # (B, T'), the part the model reads (T' < T when cropped)
    mask: Tensor | None  # (B, T' + N) True = real token; None when nothing is padded
    max_new: int
    flat: bool  # the prompt was one 1-D sequence: return 1-D
    src: Tensor | None = None  # (B, S) source ids
    src_mask: Tensor | None = None  # (B, S)


def pad_prompts(
    prompts: Sequence[Sequence[int] | Tensor], *, pad_id: int = 0, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """Left-pad prompts of different lengths into one batch.

    Args:
        prompts: B sequences of token ids (lists or 1-D tensors), each non-empty.
        pad_id: the id written in the padding columns (any valid id: the mask hides it).
        device: where to put the result.

    Returns:
        ``(ids, mask)``: (B, T) int64 ids with ``T`` the longest prompt, and the (B, T) bool mask, True = real.
    """
    if isinstance(prompts, Tensor) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise InputError("pad_prompts expects a non-empty list of token-id sequences")
    if any(not isinstance(p, (Tensor, Sequence)) or isinstance(p, str) for p in prompts):
        raise InputError(f"prompt_ids must be integer ids or a list of id lists; got {list(prompts)[:4]!r}")
    rows = [p.tolist() if isinstance(p, Tensor) else list(p) for p in prompts]
    if any(len(r) == 0 for r in rows):
        raise InputError(f"every prompt needs at least one token; got lengths {[len(r) for r in rows]}")
    bad = next((x for r in rows for x in r if isinstance(x, bool) or not isinstance(x, int)), None)
    if bad is not None:
        raise InputError(f"prompts must hold integer token ids; got {bad!r}")
    t = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (t - len(r)) + r for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[False] * (t - len(r)) + [True] * len(r) for r in rows], device=device)
    return ids, mask  # (B, T) each


def fit_new_tokens(
    prompt_tokens: int, max_seq_len: int, max_new_tokens: int | None, *, crop: bool, default: int
) -> int:
    """The context rule: how many new tokens a prompt may ask for, or why it may not.

    ``max_new_tokens=None`` asks for ``default`` tokens, or fewer when the context leaves less room (with ``crop``,
    up to ``max_seq_len - 1``: the prompt is cropped instead).

    Args:
        prompt_tokens: T, the prompt's length.
        max_seq_len: the model's context.
        max_new_tokens: the request, or ``None``.
        crop: the prompt may be cropped to its last tokens.
        default: the request when ``max_new_tokens`` is ``None``.

    Returns:
        N, with ``T + N <= max_seq_len`` unless ``crop`` (then the model reads the prompt's last
        ``max_seq_len - N`` tokens).

    Raises:
        InputError: a request that is not an int >= 0, that leaves no room for any prompt token, or that does
            not fit beside the prompt without ``crop``.
    """
    if max_new_tokens is None:
        room = max_seq_len - 1 if crop else max_seq_len - prompt_tokens
        return min(default, max(room, 0))
    n = max_new_tokens
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise InputError(f"max_new_tokens must be an int >= 0; got {n!r}")
    if prompt_tokens + n > max_seq_len:
        if not crop:
            raise InputError(
                f"the prompt ({prompt_tokens} tokens) plus max_new_tokens ({n}) is {prompt_tokens + n}, more than "
                f"max_seq_len ({max_seq_len}); shorten the prompt, ask for fewer tokens, or pass crop=True to keep "
                f"the last {max(max_seq_len - n, 0)} prompt tokens"
            )
        if n >= max_seq_len:
            raise InputError(
                f"max_new_tokens ({n}) leaves no room for the prompt in max_seq_len ({max_seq_len}); ask for at "
                f"most {max_seq_len - 1} new tokens"
            )
    return n


def prepare(
    model: nn.Module,
    prompt: Prompt,
    max_new: int,
    crop: bool,
    src: Tensor | None,
    src_padding_mask: Tensor | None,
    prompt_mask: Tensor | None,
    pad_id: int | None,
) -> DecodeRequest:
    """Validate the inputs, crop to the context, build the padding mask over prompt and new tokens."""
    if isinstance(model, EncoderDecoder):
        decoder = model.decoder
        if src is None:
            raise InputError("an encoder-decoder model needs `src`, the (B, S) source ids to condition on")
    elif isinstance(model, Decoder):
        decoder = model
        if src is not None or src_padding_mask is not None:
            raise InputError("`src` and `src_padding_mask` are for encoder-decoder models; this is a Decoder")
    else:
        raise InputError(
            f"generate needs a Decoder or an EncoderDecoder (a model with an LM head); got {type(model).__name__}"
        )
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
        raise InputError(f"max_new_tokens must be an int >= 0; got {max_new!r}")  # before the prompt's checks
    device = decoder.embed.device
    if isinstance(prompt, Sequence) and any(isinstance(i, bool) for i in prompt):  # bool is an int to Python
        raise InputError(f"prompt_ids must hold integer token ids, not booleans; got {list(prompt)[:6]!r}")
    if _is_id_list(prompt):
        prompt = torch.tensor(prompt, dtype=torch.long)  # one prompt given as a list of ids
    flat = isinstance(prompt, Tensor) and prompt.dim() == 1
    if not isinstance(prompt, Tensor):
        if prompt_mask is not None:
            raise InputError("prompt_padding_mask is for a (B, T) tensor prompt; a list of prompts is padded here")
        prompt, prompt_mask = pad_prompts(prompt, pad_id=pad_id or 0, device=device)
    elif flat:
        prompt = prompt[None]  # (T,) -> (1, T)
        if isinstance(prompt_mask, Tensor) and prompt_mask.dim() == 1:
            prompt_mask = prompt_mask[None]
    cfg = decoder.config
    b, t = check_tokens(prompt, cfg.replace(max_seq_len=max(cfg.max_seq_len, prompt.shape[-1])), name="prompt_ids")
    prompt = prompt.to(device=device, dtype=torch.long)
    mask = _check_prompt_mask(prompt_mask, b, t, device) if prompt_mask is not None else None
    seen, context = prompt, cfg.max_seq_len
    fit_new_tokens(t, context, max_new, crop=crop, default=max_new)
    if t + max_new > context:
        keep = context - max_new
        seen = prompt[:, -keep:]  # (B, T')
        mask = mask[:, -keep:] if mask is not None else None
    if mask is not None:
        full = torch.ones(b, seen.shape[1] + max_new, dtype=torch.bool, device=device)  # (B, T' + N)
        full[:, : seen.shape[1]] = mask
        mask = full
    run = DecodeRequest(model=model, decoder=decoder, prompt=prompt, seen=seen, mask=mask, max_new=max_new, flat=flat)
    if src is not None:
        if not isinstance(src, Tensor) or src.dim() != 2 or src.shape[0] != b:
            got = tuple(src.shape) if isinstance(src, Tensor) else type(src).__name__
            raise InputError(f"src must be a tensor of shape (B, S) with B = {b} like the prompt; got {got}")
        run.src, run.src_mask = src.to(device), src_padding_mask
    return run


def _is_id_list(prompt: Prompt) -> TypeIs[Sequence[int]]:
    """One prompt given as a non-empty list of ids (not a list of prompts)."""
    return isinstance(prompt, Sequence) and len(prompt) > 0 and all(isinstance(i, int) for i in prompt)


def _check_prompt_mask(mask: object, b: int, t: int, device: torch.device) -> Tensor | None:
    """A (B, T) left-padding mask, or ``None`` when every token is real."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise InputError(f"prompt_padding_mask must be a bool tensor (True = real token); got {got}")
    if tuple(mask.shape) != (b, t):
        raise InputError(f"prompt_padding_mask must have the prompt's shape ({b}, {t}); got {tuple(mask.shape)}")
    mask = mask.to(device)
    if not bool(mask[:, -1].all()):
        raise InputError(
            "prompt_padding_mask must pad on the left (every row's last token real) so that all rows grow in the "
            "same column; move the padding to the start of each row"
        )
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise InputError("prompt_padding_mask has a padding token after a real one; pad on the left only")
    return None if bool(mask.all()) else mask
