"""The forward passes of generation: the prompt once, then one token at a time.

Shape notation: B batch, T prompt length, N new tokens, L = T + N - 1 cached positions, C model width,
H query heads, Hkv key/value heads, Dh head width, V vocabulary.

Two implementations compute the same logits:

* ``FullDecode`` calls the model's own ``run`` for every step: any model (encoder-decoder, post-LN, the uncached
  path), with every check and mask the layers apply.
* ``LeanDecode``, for pre-LN decoder-only models with a cache, runs the prompt through the model's ``run`` in
  chunks of ``PROMPT_CHUNK`` positions (:func:`~oneblock.inference.spans.spans`: a long prompt's
  temporaries, such as the feed-forward's (T, 2 d_ff) products, stay those of one chunk; the server reads prompts
  in its own fixed chunks, :mod:`oneblock.inference.prefill`, for its prefix cache; a chunked read differs from a
  one-pass read by float32 rounding only) and then each new token through
  ``step``: the same modules (norms, feed-forward, output projection) called directly, with everything that does
  not change between tokens made once, before the first: the key/value buffers of the exact length the
  generation needs (a sliding-window layer's a ring of its window: ``RingKVCache``), the rotary tables and padding
  masks of every position, and one fused query/key/value matrix per layer (the file's block matrix for a GGUF
  model). A step then validates nothing and builds no mask: a single new query attends to every cached key, so
  causality needs no mask, and padding is a view of the precomputed one. ``torch.compile`` can compile ``step``
  (``compile=True``; off on the CPU, where it measured slower). Where the C++ library is built and the model
  qualifies, each token instead goes through the native step (:mod:`oneblock.inference.native_step`: one call per
  token); ``step`` stays the reference it mirrors, and the fallback (``ONEBLOCK_NATIVE_STEP=0``, no compiler, LoRA
  wrappers, a narrower cache, ``compile``). The native step reads the prompt of one row too, a chunk a call, where
  it is shorter than ``GEMM_ROWS`` or every chunk takes the integer kernels anyway (``NativeStep.reads``): its rows
  give what decoding them one at a time gives, the server's chunked read included.

Tests prove the lean step's logits equal the full forward's within 1e-5 in float32, with identical greedy tokens.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from oneblock.errors import ConfigError
from oneblock.inference.compile_policy import compile_backend
from oneblock.inference.native_step import CACHE_DTYPES, NativeStep
from oneblock.inference.plan import DecodePlan, attend_cached, heads_of_one_token
from oneblock.inference.process import return_free_memory
from oneblock.inference.request import DecodeRequest
from oneblock.inference.spans import PROMPT_CHUNK, spans
from oneblock.kernels import GEMM_ROWS
from oneblock.kernels.tiles import prompt_tiles
from oneblock.layers.kv_cache import Cache
from oneblock.layers.scratch import release as release_scratch
from oneblock.models.encoder_decoder import EncoderDecoder


class FullDecode:
    """Next-token logits (B, V) after the prompt, then after each fed token, through ``Decoder.run``.

    The source encoding, the cache, the positions and the padding mask are made once; each step calls the stack
    directly, skipping ``Decoder.forward``'s checks of the ids (the prompt was checked once, and sampled ids are in
    range by construction).
    """

    def __init__(self, run: DecodeRequest, use_cache: bool) -> None:
        self.run, self.decoder = run, run.decoder
        self.memory: Tensor | None = None  # (B, S, C): an encoder-decoder's source, encoded once
        if isinstance(run.model, EncoderDecoder) and run.src is not None:
            self.memory = run.model.encode(run.src, run.src_mask)
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
            last_only=True,
        )  # (B, 1, C)
        logits = self.decoder.logits(hidden[:, -1:])[:, 0]  # (B, 1, C) -> (B, V)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32; fp64 stays


class LeanDecode:
    """Prompt through ``Decoder.run``; each new token through ``step``, with nothing rebuilt per token.

    Args:
        run: the validated generation (prompt, mask, number of new tokens).
        compile: compile ``step`` with ``torch.compile``: ``True`` for inductor where it is faster (not on the
            CPU, unless ``ONEBLOCK_COMPILE=force``: see :mod:`oneblock.inference.compile_policy`), or a backend's
            name, always honoured (``"aot_eager"`` traces without generating code, in seconds). The first call
            pays the compilation; ``compile_seconds`` records that first call's time.
        cache_dtype: dtype of the stored keys and values (default: the model's).
        native: decode with the native step where it applies (``None``, the default: unless
            ``ONEBLOCK_NATIVE_STEP=0``); ``False`` always runs ``step``. ``native`` tells which one runs.
        prompt_chunk: positions of the prompt read at a time (a remainder shorter than ``GEMM_ROWS`` joins the
            last chunk).

    Raises:
        ConfigError: a ``prompt_chunk`` that is not a positive integer.
    """

    def __init__(
        self,
        run: DecodeRequest,
        *,
        compile: bool | str = False,
        cache_dtype: torch.dtype | None = None,
        native: bool | None = None,
        prompt_chunk: int = PROMPT_CHUNK,
    ) -> None:
        model = run.decoder
        self.run, self.model = run, model
        if isinstance(prompt_chunk, bool) or not isinstance(prompt_chunk, int) or prompt_chunk < 1:
            raise ConfigError(f"prompt_chunk is the positions of a prompt read at a time, >= 1; got {prompt_chunk!r}")
        self.prompt_chunk = prompt_chunk
        b, t = run.seen.shape
        total = t + max(run.max_new - 1, 0)  # the last new token is sampled, never fed back
        dtype = model.embed.dtype
        self.compute_dtype = dtype
        total = max(total, 1)
        self.arange = torch.arange(total, device=run.seen.device)  # positions of a batch without padding
        self.positions: Tensor | None = None  # (B, total)
        self.mask: Tensor | None = None  # (B, 1, 1, total) True = real key
        if run.mask is not None:
            self.positions = (run.mask.long().cumsum(dim=-1) - 1).clamp(min=0)[:, :total]
            self.mask = run.mask[:, None, None, :total]
        rope = model.rope
        self.cos: Tensor | None = None  # (B or 1, 1, total, Dh): every position's table, sliced per step
        self.sin: Tensor | None = None
        if rope is not None:
            where = self.positions if self.positions is not None else torch.arange(total)
            cos, sin = rope(where.to(rope.cos.device), dtype)
            self.cos, self.sin = cos, sin
        self.local_rope: Tensor | None = None  # (2, B or 1, 1, total, Dh): Gemma 3's local layers' tables
        if model.rope_local is not None:
            where = self.positions if self.positions is not None else torch.arange(total)
            self.local_rope = torch.stack(model.rope_local(where.to(model.rope_local.cos.device), dtype))
        plan = DecodePlan.of(model)
        self.blocks, self.qkv, self.sizes = plan.blocks, plan.qkv, plan.sizes
        self.heads, self.kv_heads, self.d_head = plan.heads, plan.kv_heads, plan.d_head
        self.end = 0
        self.compile_seconds: float | None = None
        backend = compile_backend(compile, run.seen.device)  # None on the CPU unless forced: see compile_policy
        # Only a compiled step is kept: a bound method on the instance would make a reference cycle, and so keep the
        # key/value cache alive past the generation, until the collector's next full pass.
        self._compiled_step = None if backend is None else torch.compile(self.step, dynamic=True, backend=backend)
        self.native: NativeStep | None = None
        self.python_reason: str | None = None  # why ``step`` runs rather than the native step, for the user
        cache_type = cache_dtype or dtype  # as ``new_cache`` makes it
        if native is False:
            self.python_reason = "the Python step was asked for (native=False)"
        elif backend is not None:
            self.python_reason = "torch.compile compiles the Python step"
        elif cache_type not in CACHE_DTYPES:
            self.python_reason = f"the native step keeps a float32 or float16 cache, and this one is {cache_type}"
        else:
            found = NativeStep.plan(model)
            self.native, self.python_reason = (found, None) if isinstance(found, NativeStep) else (None, found)
        # Whole, allocated once; a local layer's a ring of its window and the rows of a native prompt read, all
        # written before any attends (a chunk of spans: fewer than prompt_chunk + GEMM_ROWS rows).
        long_reads = self.native is not None and self.native.reads(prompt_chunk + GEMM_ROWS)
        spare = prompt_chunk + GEMM_ROWS if long_reads else GEMM_ROWS
        self.cache = model.new_cache(b, max_len=total, dtype=cache_dtype, chunk=total, spare=spare)
        if self.native is not None:
            self._native_rows(run, total)

    @property
    def _compiled(self) -> bool:
        """Whether the steps run through ``torch.compile``."""
        return self._compiled_step is not None

    def _native_rows(self, run: DecodeRequest, total: int) -> None:
        """Per position, every row's position and cache column, (total, B) int64; each row's first real column."""
        b, t = run.seen.shape
        where = self.positions if self.positions is not None else self.arange[None].expand(b, total)
        self.row_positions = where.T.contiguous()  # (total, B): row ``position`` is one step's
        self.row_columns = self.arange[:, None].expand(total, b).contiguous()  # (total, B)
        self.row_starts = torch.zeros(b, dtype=torch.long)  # (B,) left padding is never attended
        if run.mask is not None:
            self.row_starts = (~run.mask[:, :t]).sum(dim=-1)

    def next(self, fed: Tensor | None) -> Tensor:
        """The logits (B, V) in float32 after ``fed`` (B,) (``None`` on the first call: the prompt)."""
        if fed is None:
            return self._prompt()
        position = self.end
        self.end += 1
        if self._compiled_step is not None:
            if self.compile_seconds is not None:
                return self._compiled_step(fed, position)
            start = time.perf_counter()
            logits = self._compiled_step(fed, position)
            self.compile_seconds = time.perf_counter() - start
            return logits
        return self.native_step(fed, position) if self.native is not None else self.step(fed, position)

    def _prompt(self) -> Tensor:
        run, model = self.run, self.model
        t = run.seen.shape[1]
        chunks = spans(0, t, self.prompt_chunk, GEMM_ROWS)
        if self._native_reads(chunks):
            return self._native_prompt(chunks)
        with prompt_tiles():  # bfloat16 tiles where they are faster (oneblock.kernels.tiles)
            for start, end in chunks:
                hidden = model.run(
                    run.seen[:, start:end],
                    padding_mask=run.mask[:, :end] if run.mask is not None else None,
                    positions=self.positions[:, start:end] if self.positions is not None else None,
                    cache=self.cache,
                    last_only=end == t,  # the last chunk's last row is the one read
                )  # (B, end - start or 1, C)
        # The chunks' temporaries, freed into the C heap, go back to the system before the decode fills the rest of
        # the cache: kept, they would count in the peak beside it.
        release_scratch()
        return_free_memory()
        self.end = t
        logits = model.logits(hidden[:, -1])  # (B, V)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def _native_reads(self, chunks: list[tuple[int, int]]) -> bool:
        """Whether the native step reads the prompt in these chunks: one row, without padding, each chunk one it
        reads (``NativeStep.reads``)."""
        return (
            self.native is not None and self.run.seen.shape[0] == 1 and self.positions is None
            and all(self.native.reads(end - start) for start, end in chunks)
        )  # fmt: skip

    def _native_prompt(self, chunks: list[tuple[int, int]]) -> Tensor:
        """A prompt of one row in calls of the native step, a chunk each (as the server reads it, in its own
        chunks: the rows' results do not depend on the chunks): logits (1, V) float32."""
        native, seen = self.native, self.run.seen[0]
        assert native is not None  # the caller checked
        for start, end in chunks[:-1]:
            native.fill(seen[start:end], start, self.cache)
        start, end = chunks[-1]
        logits = native.prompt(seen[start:end], start, self.cache)
        return_free_memory()  # the chunks' buffers, freed into the C heap, back to the system before the decode
        self.end = end
        return logits[None]

    def step(self, fed: Tensor, position: int) -> Tensor:
        """Logits (B, V) of the token after ``fed`` (B,), which sits at ``position`` (the cache holds the ones
        before). Trusted inputs: no checks, no masks built, nothing the size of the model allocated."""
        model, end = self.model, position + 1
        where = self.positions if self.positions is not None else self.arange
        x = model.embed(fed[:, None], where[..., position:end])  # (B, 1, C)
        mask = self.mask[..., :end] if self.mask is not None else None  # (B, 1, 1, end) view
        cos = self.cos[:, :, position : position + 1] if self.cos is not None else None  # (B or 1, 1, 1, Dh)
        sin = self.sin[:, :, position : position + 1] if self.sin is not None else None
        local = self.local_rope[:, :, :, position : position + 1] if self.local_rope is not None else None
        for block, qkv, layer in zip(self.blocks, self.qkv, self.cache.layers, strict=True):
            c, s = (local[0], local[1]) if local is not None and block.attn.local_rope else (cos, sin)
            q, k, v = heads_of_one_token(qkv(block.attn_norm(x)), self.sizes, self.d_head, c, s, block.attn)
            keys, values = layer.write(position, k, v)  # (B, Hkv, end, Dh) views; a write past the end is refused
            out = attend_cached(block.attn, q, keys, values, mask)  # (B, H, 1, Dh)
            x = x + block.attn_out(block.attn.merge(out))  # heads side by side, the output projection
            x = x + block.ffn_out(block.ffn(block.ffn_norm(x)))
        if model.final_norm is not None:
            x = model.final_norm(x)
        logits = model.logits(x[:, 0])  # (B, V)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def native_step(self, fed: Tensor, position: int) -> Tensor:
        """``step``'s logits (B, V) float32, computed by one call to the native step."""
        layers = self.cache.layers
        logits = self.native(  # type: ignore[misc]  # set whenever this method is the step
            fed.contiguous(), self.row_positions[position], self.row_columns[position], self.row_starts,
            [layer.k for layer in layers], [layer.v for layer in layers],
        )  # fmt: skip
        for layer in layers:
            layer.length = position + 1  # as ``KVCache.write`` leaves it
        return logits
