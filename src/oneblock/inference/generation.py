"""Autoregressive generation: feed the prompt once, then one token at a time, reusing the key/value cache.

Shape notation: B batch, T prompt length, N new tokens, S source length, V vocabulary.

Decoder-only models continue ``prompt_ids``; encoder-decoder models encode ``src`` once and continue the decoder
prompt ``prompt_ids`` (say ``[[decoder_start_token_id]]``), with the cross-attention keys and values computed on the
first step and kept in the cache.

Prompts of different lengths share a batch by **left** padding: every row ends at the same column, so each step
appends one column for all rows. Padding positions are masked as keys everywhere, and positions count real tokens
only (``cumsum(mask) - 1``), so a padded row computes what it computes alone. ``pad_prompts`` builds the padded
ids and the mask; ``generate`` also accepts the list of prompts directly.

Context rule (``fit_new_tokens``, which the CLI calls too): the prompt plus ``max_new_tokens`` must fit in
``max_seq_len``. Otherwise ``generate`` raises ``InputError``, unless ``crop=True``, in which case the model sees
only the last ``max_seq_len - max_new_tokens`` prompt tokens (the returned sequences still start with the whole
prompt). There is no sliding window: the context is never exceeded, so ``max_new_tokens`` itself must be below
``max_seq_len``.

The forward passes themselves live in ``oneblock.inference.decode``: a lean per-token step for pre-LN decoders,
the model's full forward for everything else.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
from torch import Tensor, nn

from oneblock.errors import InputError
from oneblock.inference.decode import FullDecode, LeanDecode
from oneblock.inference.logprobs import LogprobTrace
from oneblock.inference.plan import lean_supported
from oneblock.inference.request import DecodeRequest, Prompt, prepare
from oneblock.inference.sampler_state import RowSamplers
from oneblock.inference.sampling import Sampling

if TYPE_CHECKING:
    from oneblock.inference.constraints import Constraint


@overload
def generate(
    model: nn.Module, prompt_ids: Prompt, max_new_tokens: int, *, stream: Callable[[Tensor], object] | None = None,
    return_logits: Literal[False] = False, **options: Any,
) -> Tensor: ...  # fmt: skip


@overload
def generate(
    model: nn.Module, prompt_ids: Prompt, max_new_tokens: int, *, stream: Callable[[Tensor], object] | None = None,
    return_logits: Literal[True], **options: Any,
) -> tuple[Tensor, Tensor]: ...  # fmt: skip


def generate(
    model: nn.Module,
    prompt_ids: Prompt,
    max_new_tokens: int,
    *,
    stream: Callable[[Tensor], object] | None = None,
    return_logits: bool = False,
    **options: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """Continue ``prompt_ids`` by up to ``max_new_tokens`` tokens.

    Args:
        model, prompt_ids, max_new_tokens: see ``generate_stream``.
        stream: called with the (B,) new ids after every step, as soon as they are chosen.
        **options: every keyword of ``generate_stream``: ``sampling=Sampling(...)`` or its fields
            (``temperature``, ``top_k``, ``top_p``, ``min_p``, ``presence_penalty``, ``frequency_penalty``,
            ``repetition_penalty``, ``logit_bias``, ``greedy``, ``seed``), ``constraint``, ``logprobs``,
            ``eos_id``, ``pad_id``, ``use_cache``, ``crop``, ``src``, ``src_padding_mask``,
            ``prompt_padding_mask``, ``return_logits``, ``compile``, ``cache_dtype``, ``stats``.

    Returns:
        (B, T + n) ids, the prompt followed by the ``n <= max_new_tokens`` new tokens ((T + n,) for a 1-D prompt).
        ``n < max_new_tokens`` only when every row has produced an ``eos_id``. With ``return_logits``, also the
        (B, n, V) logits, float32 (float64 for a float64 model), ((n, V) for a 1-D prompt).

    Raises:
        InputError: see ``generate_stream``.
    """
    steps = generate_stream(model, prompt_ids, max_new_tokens, return_logits=return_logits, **options)
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
    sampling: Sampling | None = None,
    constraint: Constraint | None = None,
    logprobs: LogprobTrace | None = None,
    eos_id: int | Sequence[int] | None = None,
    pad_id: int | None = None,
    use_cache: bool = True,
    crop: bool = False,
    src: Tensor | None = None,
    src_padding_mask: Tensor | None = None,
    prompt_padding_mask: Tensor | None = None,
    return_logits: bool = False,
    compile: bool | str = False,
    cache_dtype: torch.dtype | None = None,
    stats: dict[str, Any] | None = None,
    **sampling_options: Any,
) -> Generator[Tensor, None, Tensor | tuple[Tensor, Tensor]]:
    """Generation as an iterator: yields each step's (B,) new ids; its return value is ``generate``'s.

    The arguments are validated when it is called; the model runs as it is iterated.

    Args:
        model: a ``Decoder`` or an ``EncoderDecoder`` (run in eval mode; its mode is restored afterwards).
        prompt_ids: (B, T) or (T,) int64 ids, a list of ids (one prompt), or a list of B id lists of any
            lengths (left-padded with ``pad_id``, or 0); for an encoder-decoder model, the decoder's first tokens.
        max_new_tokens: tokens to add (0 returns the prompt).
        sampling: how to choose each token (default ``Sampling()``: temperature 1, no filtering). Each row has
            its own sampler state (``oneblock.inference.sampler_state``): its penalties count its own tokens, and
            with a seed row ``i`` draws from its own generator seeded ``seed + i``, so a row's tokens are those
            it gets alone with that seed.
        constraint: a grammar every row's text must follow (``oneblock.inference.constraints.Constraint``:
            a JSON schema, any JSON object, a Lark grammar, a regex); each row walks it on its own, its mask
            applied to the logits before sampling. ``eos_id`` defaults to the grammar's end-of-text ids,
            so a row stops when its text is complete.
        logprobs: a ``LogprobTrace`` that receives each step's log-probabilities of the chosen tokens and of
            its top-N alternatives, from the model's raw distribution (before temperature and every setting).
        eos_id: a row stops after producing this id, or any id of a list (a chat model's ``stop_ids``: Llama 3
            ends its turn with ``<|eot_id|>``, not its ``<|end_of_text|>``); generation stops when every row has.
        pad_id: fills a stopped row's remaining columns (and the left padding of a list of prompts); defaults
            to ``eos_id`` (the first, of a list).
        use_cache: reuse keys and values (fast); ``False`` recomputes the whole sequence at every step.
        crop: when the prompt plus ``max_new_tokens`` exceeds ``max_seq_len``, keep the last
            ``max_seq_len - max_new_tokens`` prompt tokens instead of raising (see ``fit_new_tokens``).
        src: (B, S) source ids; required for an encoder-decoder model, refused for a decoder.
        src_padding_mask: (B, S) bool, True = real source token.
        prompt_padding_mask: (B, T) bool, True = real token; padding must be on the left.
        return_logits: also return each step's next-token logits, before temperature and filtering.
        compile: compile the per-token step with ``torch.compile`` (pre-LN decoders with a cache): ``True``, or
            a backend's name. ``True`` runs the eager step on the CPU, where compiling measured slower, and says
            so on stderr (``ONEBLOCK_COMPILE=force`` overrides; see :mod:`oneblock.inference.compile_policy`).
        cache_dtype: dtype of the stored keys and values (default the model's; ``torch.bfloat16`` halves a float32
            model's cache); pre-LN decoders with a cache only.
        stats: a dict to fill with ``prefill_seconds``, ``decode_seconds``, ``new_tokens``, ``decode_step``
            (``"native"``, ``"python"`` or ``"full"``: which step decoded), ``decode_step_reason`` (why not the
            native one, in words, or ``None``) and, with ``compile``, ``compile_seconds`` (the first compiled
            step, compilation included).
        **sampling_options: ``Sampling``'s fields as keywords (``temperature=0.7``), instead of ``sampling``.

    Raises:
        InputError: a model without an LM head, bad ids or masks, right padding, a sequence that does not fit
            the context, sampling settings that select nothing, or an unknown keyword.

    >>> for ids in generate_stream(model, prompt, 20, greedy=True):  # doctest: +SKIP
    ...     print(tokenizer.decode(ids.tolist()), end="", flush=True)
    """
    sampling = Sampling.of(sampling, **sampling_options)
    if logprobs is not None and not isinstance(logprobs, LogprobTrace):
        raise InputError(f"logprobs must be a LogprobTrace (LogprobTrace(top=N)); got {type(logprobs).__name__}")
    stops = _stop_list(eos_id)
    if constraint is not None:
        if not callable(getattr(constraint, "start", None)):
            raise InputError(f"constraint must be a oneblock Constraint; got {type(constraint).__name__}")
        if not stops:
            stops = list(constraint.eos_ids)
        elif not set(stops) <= set(constraint.eos_ids):
            raise InputError(f"eos_id {eos_id} is not an id the grammar ends with {constraint.eos_ids}")
    run = prepare(model, prompt_ids, max_new_tokens, crop, src, src_padding_mask, prompt_padding_mask, pad_id)
    vocab = run.decoder.config.vocab_size
    if logprobs is not None and logprobs.top > vocab:
        raise InputError(f"logprobs asks for the top {logprobs.top} tokens of a vocabulary of {vocab}")
    for name, value in (*(("eos_id", i) for i in stops), ("pad_id", pad_id)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab):
            shown = value if name == "pad_id" or isinstance(eos_id, int) else eos_id
            raise InputError(f"{name} must be an id in [0, {vocab}) (or a list of them) or None; got {shown!r}")
    if cache_dtype is not None and not (use_cache and src is None and lean_supported(model)):
        raise InputError("cache_dtype needs a pre-LN decoder-only model with use_cache=True (the lean decoding step)")
    samplers = RowSamplers.for_batch(sampling, run.seen, run.mask, vocab_size=vocab, constraint=constraint)
    options = {"compile": compile, "cache_dtype": cache_dtype}
    return _steps(run, samplers, logprobs, stops, pad_id, use_cache, return_logits, options, stats)


def _stop_list(eos_id: Any) -> list[Any]:
    """``eos_id`` as a list (empty for ``None``), its entries checked by the caller."""
    if eos_id is None:
        return []
    return list(eos_id) if isinstance(eos_id, (list, tuple)) else [eos_id]


def decode_path(decode: FullDecode | LeanDecode | None) -> dict[str, Any]:
    """``{"decode_step": "native" | "python" | "full", "decode_step_reason": why not native, or None}``."""
    if isinstance(decode, LeanDecode):
        return {
            "decode_step": "native" if decode.native is not None else "python",
            "decode_step_reason": decode.python_reason,
        }
    reason = None if decode is None else "the model is not a pre-LN decoder-only model decoding with a cache"
    return {"decode_step": "full", "decode_step_reason": reason}


def decoder_for(run: DecodeRequest, use_cache: bool, options: dict[str, Any]) -> FullDecode | LeanDecode:
    if use_cache and run.src is None and lean_supported(run.model):
        return LeanDecode(run, **options)
    return FullDecode(run, use_cache)


def _steps(
    run: DecodeRequest,
    samplers: RowSamplers,
    trace: LogprobTrace | None,
    stops: list[int],
    pad_id: int | None,
    use_cache: bool,
    return_logits: bool,
    options: dict[str, Any],
    stats: dict[str, Any] | None,
) -> Generator[Tensor, None, Tensor | tuple[Tensor, Tensor]]:
    """The generation loop: pick a token from each step's logits, hand it out, feed it back."""
    model, prompt = run.model, run.prompt
    b, device = prompt.shape[0], prompt.device
    new = torch.zeros(b, run.max_new, dtype=torch.long, device=device)  # (B, N)
    kept: list[Tensor] = []  # each (B, V) when return_logits
    done = torch.zeros(b, dtype=torch.bool, device=device)
    stop = torch.tensor(stops, dtype=torch.long, device=device)  # (K,): the ids that end a row
    fill = pad_id if pad_id is not None else stops[0] if stops else 0  # a stopped row's columns
    n = 0
    was_training = model.training
    model.eval()
    clock = time.perf_counter()
    try:
        with torch.inference_mode():
            decode = decoder_for(run, use_cache, options) if run.max_new else None
        while decode is not None and n < run.max_new:
            with torch.inference_mode():
                logits = decode.next(new[:, n - 1] if n else None)  # (B, V) float32
                if return_logits:
                    kept.append(logits)
                ids = samplers.choose(logits, ~done)  # (B,): a stopped row draws nothing
                if stops:
                    ids = torch.where(done, fill, ids)  # pad_id defaults to the (first) eos_id
                    done = done | torch.isin(ids, stop)
                if trace is not None:
                    trace.record(logits, ids)
                new[:, n] = ids
                del logits  # before the next step makes its own: one (B, V) block of the C heap, reused step after step
            n += 1
            if n == 1 and stats is not None:
                stats["prefill_seconds"] = time.perf_counter() - clock
                clock = time.perf_counter()
            yield ids.clone()
            if stops and bool(done.all()):
                break
    finally:
        model.train(was_training)
        if stats is not None and n:
            stats["decode_seconds"] = time.perf_counter() - clock
            stats["new_tokens"] = n
            if isinstance(decode, LeanDecode) and decode.compile_seconds is not None:
                stats["compile_seconds"] = decode.compile_seconds
        if stats is not None:
            stats.update(decode_path(decode))
    out = torch.cat([prompt, new[:, :n]], dim=1)  # (B, T + n)
    if not return_logits:
        return out[0] if run.flat else out
    vocab = run.decoder.config.vocab_size
    logits = torch.stack(kept, dim=1) if kept else torch.zeros(b, 0, vocab, device=device)  # (B, n, V)
    return (out[0], logits[0]) if run.flat else (out, logits)
