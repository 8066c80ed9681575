"""Autoregressive generation: feed the prompt once, then one token at a time, reusing the key/value cache.

Shape notation: B batch, T prompt length, N new tokens, S source length, V vocabulary.

Decoder-only models continue ``prompt_ids``; encoder-decoder models encode ``src`` once and continue the decoder
prompt ``prompt_ids`` (say ``[[decoder_start_token_id]]``), with the cross-attention keys and values computed on the
first step and kept in the cache.

Prompts of different lengths share a batch by **left** padding: every row ends at the same column, so each step
appends one column for all rows. Padding positions are masked as keys everywhere, and positions count real tokens
only (``cumsum(mask) - 1``), so a padded row computes what it computes alone. ``pad_prompts`` builds the padded
ids and the mask; ``generate`` also accepts the list of prompts directly.

Context rule: the prompt plus ``max_new_tokens`` must fit in ``max_seq_len``. Otherwise ``generate`` raises
``InputError``, unless ``crop=True``, in which case the model sees only the last ``max_seq_len - max_new_tokens``
prompt tokens (the returned sequences still start with the whole prompt). There is no sliding window: the
context is never exceeded, so ``max_new_tokens`` itself must be below ``max_seq_len``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from oneblock.errors import InputError
from oneblock.inference.sampling import check_sampling, sample_next
from oneblock.layers.kv_cache import Cache
from oneblock.models.decoder import Decoder
from oneblock.models.encoder_decoder import EncoderDecoder
from oneblock.models.inputs import check_tokens

Prompt = Tensor | Sequence[Sequence[int]]


@dataclass
class _Run:
    """Everything one generation needs, validated once, before the first forward pass."""

    model: nn.Module
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


def generate(
    model: nn.Module,
    prompt_ids: Prompt,
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
    return_logits: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Continue ``prompt_ids`` by up to ``max_new_tokens`` tokens.

    Args:
        model: a ``Decoder`` or an ``EncoderDecoder`` (run in eval mode; its mode is restored afterwards).
        prompt_ids: (B, T) or (T,) int64 ids, a list of ids (one prompt), or a list of B id lists of any
            lengths (left-padded with ``pad_id``, or 0); for an encoder-decoder model, the decoder's first tokens.
        max_new_tokens: tokens to add (0 returns the prompt).
        temperature: divides the logits before sampling; 0 means greedy.
        top_k: sample among the ``top_k`` most likely tokens only.
        top_p: nucleus sampling: among the most likely tokens holding probability ``top_p``.
        greedy: always take the most likely token.
        seed: seeds a private random generator, so the same call draws the same tokens; ``None`` draws from
            torch's global generator.
        eos_id: a row stops after producing this id; generation stops when every row has.
        pad_id: fills a stopped row's remaining columns (and the left padding of a list of prompts); defaults
            to ``eos_id``.
        use_cache: reuse keys and values (fast); ``False`` recomputes the whole sequence at every step.
        crop: when the prompt plus ``max_new_tokens`` exceeds ``max_seq_len``, keep the last
            ``max_seq_len - max_new_tokens`` prompt tokens instead of raising.
        src: (B, S) source ids; required for an encoder-decoder model, refused for a decoder.
        src_padding_mask: (B, S) bool, True = real source token.
        prompt_padding_mask: (B, T) bool, True = real token; padding must be on the left.
        stream: called with the (B,) new ids after every step, as soon as they are chosen.
        return_logits: also return each step's next-token logits, before temperature and filtering.

    Returns:
        (B, T + n) ids, the prompt followed by the ``n <= max_new_tokens`` new tokens ((T + n,) for a 1-D prompt).
        ``n < max_new_tokens`` only when every row has produced ``eos_id``. With ``return_logits``, also the
        (B, n, V) logits, float32 (float64 for a float64 model), ((n, V) for a 1-D prompt).

    Raises:
        InputError: a model without an LM head, bad ids or masks, right padding, a sequence that does not fit
            the context, or sampling settings that select nothing.
    """
    steps = generate_stream(
        model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy,
        seed=seed, eos_id=eos_id, pad_id=pad_id, use_cache=use_cache, crop=crop, src=src,
        src_padding_mask=src_padding_mask, prompt_padding_mask=prompt_padding_mask, return_logits=return_logits,
    )  # fmt: skip
    while True:
        try:
            new = next(steps)
        except StopIteration as done:
            return done.value
        if stream is not None:
            stream(new)


def generate_stream(
    model: nn.Module,
    prompt_ids: Prompt,
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
    return_logits: bool = False,
) -> Generator[Tensor, None, Tensor | tuple[Tensor, Tensor]]:
    """``generate`` as an iterator: yields each step's (B,) new ids; its return value is ``generate``'s.

    Takes ``generate``'s arguments except ``stream``. The arguments are validated when it is called; the model
    runs as it is iterated.

    >>> for ids in generate_stream(model, prompt, 20, greedy=True):  # doctest: +SKIP
    ...     print(tokenizer.decode(ids.tolist()), end="", flush=True)
    """
    check_sampling(temperature, top_k, top_p)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InputError(f"seed must be an int or None; got {seed!r}")
    if seed is not None and not -(2**63) <= seed < 2**64:  # what torch.Generator.manual_seed can hold
        raise InputError(f"seed must lie in [-2**63, 2**64); got {seed}")
    run = _prepare(model, prompt_ids, max_new_tokens, crop, src, src_padding_mask, prompt_padding_mask, pad_id)
    vocab = run.decoder.config.vocab_size
    for name, value in (("eos_id", eos_id), ("pad_id", pad_id)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab):
            raise InputError(f"{name} must be an id in [0, {vocab}) or None; got {value!r}")
    pad_id = eos_id if pad_id is None else pad_id
    sample = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "greedy": greedy}
    return _steps(run, sample, seed, eos_id, pad_id, use_cache, return_logits)


def _steps(
    run: _Run,
    sample: dict[str, object],
    seed: int | None,
    eos_id: int | None,
    pad_id: int | None,
    use_cache: bool,
    return_logits: bool,
) -> Generator[Tensor, None, Tensor | tuple[Tensor, Tensor]]:
    """The generation loop: pick a token from each step's logits, hand it out, feed it back."""
    model, prompt = run.model, run.prompt
    b, device = prompt.shape[0], prompt.device
    new = torch.zeros(b, run.max_new, dtype=torch.long, device=device)  # (B, N)
    kept: list[Tensor] = []  # each (B, V) when return_logits
    done = torch.zeros(b, dtype=torch.bool, device=device)
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    n = 0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            decode = _Decode(run, use_cache) if run.max_new else None
        while n < run.max_new:
            with torch.inference_mode():
                logits = decode.next(new[:, n - 1] if n else None)  # (B, V) float32
                if return_logits:
                    kept.append(logits)
                ids = sample_next(logits, generator=generator, **sample)  # (B,)
                if eos_id is not None:
                    ids = torch.where(done, pad_id, ids)
                    done = done | (ids == eos_id)
                new[:, n] = ids
            n += 1
            yield ids.clone()
            if eos_id is not None and bool(done.all()):
                break
    finally:
        model.train(was_training)
    out = torch.cat([prompt, new[:, :n]], dim=1)  # (B, T + n)
    if not return_logits:
        return out[0] if run.flat else out
    vocab = run.decoder.config.vocab_size
    logits = torch.stack(kept, dim=1) if kept else torch.zeros(b, 0, vocab, device=device)  # (B, n, V)
    return (out[0], logits[0]) if run.flat else (out, logits)


def _prepare(
    model: nn.Module,
    prompt: Prompt,
    max_new: int,
    crop: bool,
    src: Tensor | None,
    src_padding_mask: Tensor | None,
    prompt_mask: Tensor | None,
    pad_id: int | None,
) -> _Run:
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
        raise InputError(f"max_new_tokens must be an int >= 0; got {max_new!r}")
    device = decoder.embed.tok.weight.device
    if isinstance(prompt, Sequence) and len(prompt) and all(isinstance(i, int) for i in prompt):
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
    if mask is not None:
        full = torch.ones(b, seen.shape[1] + max_new, dtype=torch.bool, device=device)  # (B, T' + N)
        full[:, : seen.shape[1]] = mask
        mask = full
    run = _Run(model=model, decoder=decoder, prompt=prompt, seen=seen, mask=mask, max_new=max_new, flat=flat)
    if src is not None:
        if not isinstance(src, Tensor) or src.dim() != 2 or src.shape[0] != b:
            got = tuple(src.shape) if isinstance(src, Tensor) else type(src).__name__
            raise InputError(f"src must be a tensor of shape (B, S) with B = {b} like the prompt; got {got}")
        run.src, run.src_mask = src.to(device), src_padding_mask
    return run


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


class _Decode:
    """Next-token logits (B, V) after the prompt, then after each fed token.

    Everything that does not change between steps is made once here: the source encoding, the cache, the
    positions and the padding mask. Each step then calls the stack directly, skipping ``Decoder.forward``'s checks
    of the ids: the prompt was checked once in ``_prepare`` and sampled ids are in range by construction.
    """

    def __init__(self, run: _Run, use_cache: bool) -> None:
        self.run, self.decoder = run, run.decoder
        self.memory = run.model.encode(run.src, run.src_mask) if run.src is not None else None  # (B, S, C)
        b, t = run.seen.shape
        self.cache: Cache | None = self.decoder.new_cache(b, max_len=t + run.max_new - 1) if use_cache else None
        self.positions: Tensor | None = None  # (B, T' + N); None: 0, 1, 2, ... in every row
        if run.mask is not None:
            self.positions = (run.mask.long().cumsum(dim=-1) - 1).clamp(min=0)  # left padding shares position 0
        self.tokens = run.seen  # (B, t) everything read so far (the uncached path rereads it)
        self.end = 0  # columns consumed so far

    def next(self, fed: Tensor | None) -> Tensor:
        """The logits (B, V), float32 or wider, after ``fed`` (B,) (``None`` on the first call: the prompt)."""
        if fed is None:
            start, x = 0, self.tokens
        elif self.cache is not None:
            start, x = self.end, fed[:, None]  # (B, 1)
        else:
            self.tokens = torch.cat([self.tokens, fed[:, None]], dim=1)  # (B, end + 1)
            start, x = 0, self.tokens
        end = start + x.shape[1]
        self.end = end
        run = self.run
        hidden = self.decoder.run(
            x,
            padding_mask=run.mask[:, :end] if run.mask is not None else None,
            positions=self.positions[:, start:end] if self.positions is not None else None,
            cache=self.cache,
            memory=self.memory,
            memory_mask=run.src_mask,
        )
        logits = self.decoder.logits(hidden[:, -1:])[:, 0]  # (B, 1, C) -> (B, V)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32; fp64 stays
