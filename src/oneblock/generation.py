"""Autoregressive generation: feed the prompt once, then one token at a time, reusing the key/value cache.

Shape notation: B batch, T prompt length, N new tokens, S source length, V vocabulary.

Decoder-only models continue ``prompt_ids``; encoder-decoder models encode ``src`` once and continue the decoder
prompt ``prompt_ids`` (say ``[[decoder_start_token_id]]``), with the cross-attention keys and values computed on the
first step and kept in the cache.

Prompts of different lengths share a batch by **left** padding: every row ends at the same column, so each step
appends one column for all rows. Padding positions are masked as keys everywhere, and positions count real tokens
only (``cumsum(mask) - 1``), so a padded row computes exactly what it computes alone.

Context rule: the prompt plus ``max_new_tokens`` must fit in ``max_seq_len``. Otherwise ``generate`` raises
``InputError``, unless ``crop=True``, in which case the model sees only the last ``max_seq_len - max_new_tokens``
prompt tokens (the returned sequences still start with the whole prompt).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from oneblock.errors import InputError
from oneblock.layers.kv_cache import Cache
from oneblock.models.decoder import Decoder
from oneblock.models.encoder_decoder import EncoderDecoder
from oneblock.models.inputs import check_tokens
from oneblock.sampling import check_sampling, sample_next


@dataclass
class _Run:
    """Everything one generation needs, validated once, before the first forward pass."""

    decoder: Decoder
    prompt: Tensor  # (B, T), the whole prompt as given
    seen: Tensor  # (B, T'), the part the model reads (T' < T when cropped)
    mask: Tensor | None  # (B, T' + N) True = real token; None when nothing is padded
    positions: Tensor | None  # (B, T' + N); None means 0, 1, 2, ... for every row
    max_new: int
    memory: Tensor | None = None  # encoder output (B, S, C)
    memory_mask: Tensor | None = None  # (B, S)
    feed: Tensor | None = None  # (B,), the ids chosen last, to be read next


def generate(
    model: nn.Module,
    prompt_ids: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    seed: int | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
    use_cache: bool = True,
    crop: bool = False,
    src: Tensor | None = None,
    src_padding_mask: Tensor | None = None,
    prompt_padding_mask: Tensor | None = None,
    stream: Callable[[Tensor], object] | None = None,
) -> Tensor:
    """Continue ``prompt_ids`` by up to ``max_new_tokens`` tokens.

    Args:
        model: a ``Decoder`` or an ``EncoderDecoder`` (run in eval mode; its mode is restored afterwards).
        prompt_ids: (B, T) or (T,) int64 ids; for an encoder-decoder model, the decoder's first tokens.
        max_new_tokens: tokens to add (0 returns the prompt).
        temperature: divides the logits before sampling; 0 means greedy.
        top_k: sample among the ``top_k`` most likely tokens only.
        top_p: nucleus sampling: among the most likely tokens holding probability ``top_p``.
        greedy: always take the most likely token.
        seed: seeds a private random generator, so the same call draws the same tokens; ``None`` draws from
            torch's global generator.
        eos_id: a row stops after producing this id; generation stops when every row has.
        pad_id: fills a stopped row's remaining columns; defaults to ``eos_id``.
        use_cache: reuse keys and values (fast); ``False`` recomputes the whole sequence at every step.
        crop: when the prompt plus ``max_new_tokens`` exceeds ``max_seq_len``, keep the last
            ``max_seq_len - max_new_tokens`` prompt tokens instead of raising.
        src: (B, S) source ids; required for an encoder-decoder model, refused for a decoder.
        src_padding_mask: (B, S) bool, True = real source token.
        prompt_padding_mask: (B, T) bool, True = real token; padding must be on the left.
        stream: called with the (B,) new ids after every step, as soon as they are chosen.

    Returns:
        (B, T + n) ids, the prompt followed by the ``n <= max_new_tokens`` new tokens ((T + n,) for a 1-D prompt).
        ``n < max_new_tokens`` only when every row has produced ``eos_id``.

    Raises:
        InputError: a model without an LM head, bad ids or masks, right padding, a sequence that does not fit
            the context, or sampling settings that select nothing.
    """
    steps = generate_stream(
        model,
        prompt_ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        greedy=greedy,
        seed=seed,
        eos_id=eos_id,
        pad_id=pad_id,
        use_cache=use_cache,
        crop=crop,
        src=src,
        src_padding_mask=src_padding_mask,
        prompt_padding_mask=prompt_padding_mask,
    )
    while True:
        try:
            new = next(steps)
        except StopIteration as done:
            return done.value
        if stream is not None:
            stream(new)


def generate_stream(
    model: nn.Module,
    prompt_ids: Tensor,
    max_new_tokens: int,
    **options: object,
) -> Generator[Tensor, None, Tensor]:
    """``generate`` as a generator: yields each step's (B,) new ids; its return value is ``generate``'s.

    Takes the same keyword options as ``generate`` except ``stream``. Everything is validated on the first
    ``next()``.

    >>> for ids in generate_stream(model, prompt, 20, greedy=True):  # doctest: +SKIP
    ...     print(tokenizer.decode(ids.tolist()), end="", flush=True)
    """
    return _generate(model, prompt_ids, max_new_tokens, **options)


def _generate(
    model: nn.Module,
    prompt_ids: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    seed: int | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
    use_cache: bool = True,
    crop: bool = False,
    src: Tensor | None = None,
    src_padding_mask: Tensor | None = None,
    prompt_padding_mask: Tensor | None = None,
) -> Generator[Tensor, None, Tensor]:
    check_sampling(temperature, top_k, top_p)
    flat = isinstance(prompt_ids, Tensor) and prompt_ids.dim() == 1
    if flat:
        prompt_ids = prompt_ids[None]  # (T,) -> (1, T)
        if prompt_padding_mask is not None and prompt_padding_mask.dim() == 1:
            prompt_padding_mask = prompt_padding_mask[None]
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            run = _prepare(model, prompt_ids, max_new_tokens, crop, src, src_padding_mask, prompt_padding_mask)
        vocab = run.decoder.config.vocab_size
        for name, value in (("eos_id", eos_id), ("pad_id", pad_id)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab):
                raise InputError(f"{name} must be an id in [0, {vocab}) or None; got {value!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise InputError(f"seed must be an int or None; got {seed!r}")
        pad_id = eos_id if pad_id is None else pad_id
        if max_new_tokens == 0:
            return prompt_ids[0].clone() if flat else prompt_ids.clone()
        device = run.prompt.device
        generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        b, t = run.prompt.shape
        new = torch.zeros(b, max_new_tokens, dtype=torch.long, device=device)  # (B, N)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        steps = 0
        for ids in _decode(run, use_cache):
            with torch.inference_mode():
                ids = sample_next(
                    ids, temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy, generator=generator
                )  # logits (B, V) -> ids (B,)
                if eos_id is not None:
                    ids = torch.where(done, pad_id, ids)
                    done = done | (ids == eos_id)
            new[:, steps] = ids
            steps += 1
            yield new[:, steps - 1].clone()
            if steps == max_new_tokens or (eos_id is not None and bool(done.all())):
                break
            run.feed = new[:, steps - 1]
        out = torch.cat([run.prompt, new[:, :steps]], dim=1)  # (B, T + n)
        return out[0] if flat else out
    finally:
        model.train(was_training)


def _prepare(
    model: nn.Module,
    prompt: Tensor,
    max_new: int,
    crop: bool,
    src: Tensor | None,
    src_padding_mask: Tensor | None,
    prompt_mask: Tensor | None,
) -> _Run:
    """Validate the inputs, crop to the context, build the padding mask and positions, encode the source."""
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
        raise InputError(f"max_new_tokens must be an int >= 0; got {max_new!r}")
    cfg = decoder.config
    b, t = check_tokens(prompt, cfg.replace(max_seq_len=max(cfg.max_seq_len, prompt.shape[-1])), name="prompt_ids")
    context = cfg.max_seq_len
    seen, mask = prompt, prompt_mask
    if mask is not None:
        mask = _check_prompt_mask(mask, b, t)
    if t + max_new > context:
        if not crop:
            raise InputError(
                f"the prompt ({t} tokens) plus max_new_tokens ({max_new}) is {t + max_new}, more than max_seq_len "
                f"({context}); shorten the prompt, ask for fewer tokens, or pass crop=True to keep the last "
                f"{max(context - max_new, 0)} prompt tokens"
            )
        if max_new >= context:
            raise InputError(
                f"max_new_tokens ({max_new}) leaves no room for the prompt in max_seq_len ({context}); ask for at "
                f"most {context - 1} new tokens"
            )
        keep = context - max_new
        seen = prompt[:, -keep:]  # (B, T')
        mask = mask[:, -keep:] if mask is not None else None
    run = _Run(decoder=decoder, prompt=prompt, seen=seen, mask=None, positions=None, max_new=max_new)
    if mask is not None:
        full = torch.ones(b, seen.shape[1] + max_new, dtype=torch.bool, device=prompt.device)  # (B, T' + N)
        full[:, : seen.shape[1]] = mask
        run.mask = full
        run.positions = (full.long().cumsum(dim=-1) - 1).clamp(min=0)  # left padding shares position 0
    if src is not None:
        if src.dim() != 2 or src.shape[0] != b:
            raise InputError(f"src must have shape (B, S) with B = {b} like the prompt; got {tuple(src.shape)}")
        run.memory = model.encode(src, src_padding_mask)  # validates src and its mask
        run.memory_mask = src_padding_mask
    return run


def _check_prompt_mask(mask: Tensor, b: int, t: int) -> Tensor | None:
    """A (B, T) left-padding mask, or ``None`` when every token is real."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise InputError(f"prompt_padding_mask must be a bool tensor (True = real token); got {got}")
    if tuple(mask.shape) != (b, t):
        raise InputError(f"prompt_padding_mask must have the prompt's shape ({b}, {t}); got {tuple(mask.shape)}")
    if not bool(mask[:, -1].all()):
        raise InputError(
            "prompt_padding_mask must pad on the left (every row's last token real) so that all rows grow in the "
            "same column; move the padding to the start of each row"
        )
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise InputError("prompt_padding_mask has a padding token after a real one; pad on the left only")
    return None if bool(mask.all()) else mask


def _decode(run: _Run, use_cache: bool) -> Iterator[Tensor]:
    """Yield next-token logits (B, V) after the prompt, then after each token put in ``run.feed``."""
    decoder, t = run.decoder, run.seen.shape[1]
    cache: Cache | None = None
    with torch.inference_mode():
        if use_cache:
            cache = decoder.new_cache(run.seen.shape[0], max_len=t + run.max_new - 1)
        logits = _last_logits(run, run.seen, 0, t, cache)
    yield logits
    tokens = run.seen
    for i in range(t, t + run.max_new - 1):
        with torch.inference_mode():
            feed = run.feed[:, None]  # (B, 1)
            if cache is not None:
                logits = _last_logits(run, feed, i, i + 1, cache)
            else:
                tokens = torch.cat([tokens, feed], dim=1)  # (B, i + 1)
                logits = _last_logits(run, tokens, 0, i + 1, None)
        yield logits


def _last_logits(run: _Run, tokens: Tensor, start: int, end: int, cache: Cache | None) -> Tensor:
    """Logits (B, V) of the last of ``tokens``, which sit at columns ``start .. end - 1`` of the sequence.

    Calls the stack directly: the ids were checked once in ``_prepare`` and sampled ids are in range by
    construction, so the per-call checks of ``Decoder.forward`` would only cost time.
    """
    hidden, _, _ = run.decoder.run(
        tokens,
        padding_mask=run.mask[:, :end] if run.mask is not None else None,
        positions=run.positions[:, start:end] if run.positions is not None else None,
        cache=cache,
        memory=run.memory,
        memory_mask=run.memory_mask,
    )
    return run.decoder.logits(hidden[:, -1:])[:, 0].float()  # (B, 1, C) -> (B, V)
