"""The native decode step: one call to ``oneblock::decode_step`` computes a whole token for B rows.

Shape notation: B rows, L layers, C model width, H query heads, Hkv key/value heads, Dh head width, V vocabulary.

``LeanDecode.step`` (:mod:`oneblock.inference.decode`) is the specification: per block, norm, fused q/k/v product,
rotary, cache write, attention, output projection, residual, norm, feed-forward, residual; then the final norm and
the head. Run from Python, that is about 1,200 small operations a token, each a trip through the interpreter and
the dispatcher. The C++ op (``kernels/csrc/decode_step.cpp``) runs the same passes inside one parallel region, the
threads meeting between passes, each activation rounded to 8-bit blocks once per product and shared by the stacked
matrices (q, k, v; gate, up), the norms, rotary, cache write and residual adds done in the passes that touch
the data. Block matrices of 32-value formats and K-quants (Q4_K, Q5_K, Q6_K, IQ4_XS: super-blocks of 256, read with
llama.cpp's Q8_K activation blocks) may share a product, each multiplied as ``BlockLinear`` multiplies it.

LoRA adapters served per row (``oneblock.adapters.multi``: every adapted layer a ``MultiLoraLinear`` over a plain
layer) go in too: each adapted matrix's adapters' A (r, in) and B (out, r) and scales, and at every call the
adapter of each row, read from the model's ``AdapterRows`` as the Python step's layers read it. The op adds
``(x A^T) B^T * scale`` of a row's adapter after the base product, as ``MultiLoraLinear`` does; rows of the base
(index 0) and a model without adapters compute nothing more.

:class:`NativeStep` gathers the model's own tensors once per generation (:mod:`oneblock.inference.native_fields`;
no copies: block matrices as the file's bytes, float weights as they are) into named fields
(:class:`oneblock.kernels.decode_step.StepFields`) and builds from them the ``StepPlan`` that every call passes: the
plan checks the tensors once, a call only its rows.
``NativeStep.of(model)`` returns ``None`` where the native step would not compute what the Python step computes,
so the caller keeps the Python step: models with parts other than plain ``nn.Linear`` / ``BlockLinear`` layers,
alone or under a ``MultiLoraLinear`` (a single adapter's ``LoraLinear``, int8 layers), embeddings with segments or
a norm, a scaled tied head, weights that are not float32, a model off the CPU; and everywhere when the C++ library
is not built (no compiler) or ``ONEBLOCK_NATIVE_STEP=0``. The block's options go in: per-head q/k norms (Qwen3),
sandwich norms, scaled embeddings, soft-capped scores and logits, sliding windows and local rotary tables (Gemma 2
and 3); scaled residual branches and logits (Granite); layers without rotary (SmolLM3); output norms and q/k norms
over the width (OLMo 2); rotary on the first features of each head (Phi-4-mini).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from oneblock import kernels
from oneblock.adapters.multi import AdapterRows
from oneblock.errors import ConfigError
from oneblock.inference.native_fields import Unsupported, gather
from oneblock.kernels import decode_step
from oneblock.kernels.tiles import int8_prompts
from oneblock.layers.kv_cache import Cache
from oneblock.layers.rotary import RotaryEmbedding
from oneblock.models.decoder import Decoder

ENV = "ONEBLOCK_NATIVE_STEP"
"""Set to ``0`` to decode with the Python step even where the native one applies."""

CACHE_DTYPES = (torch.float32, torch.float16)
"""The key/value caches the native step reads (a float16 one rounded as stored, to nearest even, widened as read)."""
_NO_ROWS = torch.empty(0, dtype=torch.long)  # the rows' adapters, without adapters


def enabled() -> bool:
    """Whether the native step may run: ``ONEBLOCK_NATIVE_STEP`` is not ``0`` and the C++ op exists."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    return kernels.backend() != "torch" and decode_step.defined()


class NativeStep:
    """A decoder's ``StepPlan`` (``kernels/csrc/decode_step.h``), built once; call once per token.

    Build with :meth:`of`. ``fields`` keeps the named fields the plan was built from.
    """

    def __init__(
        self, fields: decode_step.StepFields, rows: AdapterRows | None = None, tables: Sequence[RotaryEmbedding] = ()
    ) -> None:
        self.fields = fields
        self.tables = list(tables)  # the rotary tables the plan reads: filled up to each call's positions first
        self.step_plan = fields.build()
        self.n_layers = len(fields.layers)
        self.adapter_rows = rows if fields.lora else None  # ``None``: no adapters, every row computes the base
        self.interleaved = fields.interleaved()

    def reads(self, rows: int) -> bool:
        """Whether a prompt's chunk of ``rows`` positions is read by this step: below ``GEMM_ROWS`` always; more
        where every layer's matrix is interleaved and a prompt's products take the integer kernels anyway
        (``int8_prompts``): the rows then give what decoding them one at a time gives, faster than a Python read
        and with less memory."""
        return rows < kernels.GEMM_ROWS or (self.interleaved and int8_prompts())

    @classmethod
    def of(cls, model: nn.Module) -> NativeStep | None:
        """The plan of ``model``, or ``None`` where the Python step must run (see the module's docstring)."""
        plan = cls.plan(model)
        return plan if isinstance(plan, NativeStep) else None

    @classmethod
    def plan(cls, model: nn.Module) -> NativeStep | str:
        """The plan of ``model``, or, where the Python step must run, why, in a sentence for the user."""
        if type(model) is not Decoder:
            return f"the native step runs decoder-only models; this is a {type(model).__name__}"
        if os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off"):
            return f"{ENV}={os.environ[ENV]} turns it off"
        if not enabled():
            return "the C++ kernels are not built here (no C++ compiler was found, or the build failed)"
        try:
            fields, adapters = gather(model)
        except Unsupported as error:
            return f"the native step does not compute {error}"
        return cls(fields, adapters.rows, [rope for rope in (model.rope, model.rope_local) if rope is not None])

    @property
    def adapted(self) -> bool:
        """Whether the plan holds LoRA updates (each row then runs its ``AdapterRows`` index's)."""
        return bool(self.fields.lora)

    def _rows(self, b: int, *, one_sequence: bool = False) -> Tensor:
        """The (B,) int64 adapter of each row, as the adapted layers read ``AdapterRows`` in the Python step
        (``one_sequence``: B tokens of the one row selected).

        Raises:
            ConfigError: adapters selected for a number of rows other than B (one, for ``one_sequence``).
        """
        if self.adapter_rows is None:
            return _NO_ROWS
        index = self.adapter_rows.index
        if not any(index):  # none selected, or every row the base
            return torch.zeros(b, dtype=torch.long)
        if one_sequence and len(index) == 1:
            return torch.full((b,), index[0], dtype=torch.long)
        if len(index) != b:
            raise ConfigError(
                f"adapters were selected for {len(index)} rows and this step has {b}; call AdapterRows.select "
                "with one index per row before the step"
            )
        return torch.tensor(index, dtype=torch.long)

    def __call__(
        self,
        tokens: Tensor,
        positions: Tensor,
        columns: Tensor,
        starts: Tensor,
        keys: Sequence[Tensor],
        values: Sequence[Tensor],
    ) -> Tensor:
        """Logits (B, V) float32 of the token after ``tokens``; each row's key and value are written into its cache.

        Args:
            tokens: (B,) int64 ids fed.
            positions: (B,) int64 positions of those tokens (rotary angle or learned position row).
            columns: (B,) int64 cache column each row writes; it attends over columns ``starts .. columns``.
            starts: (B,) int64 first real column of each row (left padding before it is never attended).
            keys, values: per layer one (B, Hkv, capacity, Dh) float32 or float16 buffer (all of one dtype; a
                float16 cache rounds as stored, to nearest even, and widens as read), or per row and layer
                (``keys[row * L + layer]``) one (1, Hkv, capacity_row, Dh) buffer; column ``c`` at
                ``c % capacity``, so a local layer's buffer may be a ring of its window (``RingKVCache``).

        Each row runs the LoRA adapter its model's ``AdapterRows`` selected (0 or none selected: the base).

        Raises:
            ConfigError: adapters selected for a number of rows other than B.
        """
        if self.tables and positions.numel() and _computing():
            self._fill(int(positions.max()) + 1)
        return torch.ops.oneblock.decode_step(
            self.step_plan, tokens, positions, columns, starts, list(keys), list(values), self._rows(tokens.shape[0])
        )

    def _fill(self, positions: int) -> None:
        for rope in self.tables:
            rope.fill(positions)

    def prompt(self, tokens: Tensor, start: int, cache: Cache) -> Tensor:
        """Read T tokens of one sequence into its cache in one call: logits (V,) float32 of the token after the last.

        Token i sits at position and cache column ``start + i`` and attends over columns ``0 .. start + i`` (the
        ones before ``start`` already in the cache); every row's key and value are stored before any row attends,
        and only the last row's logits are computed. Each row runs the adapter ``AdapterRows`` selected for the
        one row. A row's results do not depend on the rows read with it (any chunks read the same).

        Args:
            tokens: (T,) int64 ids, T >= 1.
            start: the cache column of the first (the cache holds ``start`` positions).
            cache: one row's cache, float32 or float16, allocated for ``start + T`` positions or more (a local
                layer's ring: its window and T - 1 columns); it holds ``start + T`` after the call.

        Raises:
            ConfigError: adapters selected for more than one row.
        """
        return self._read(tokens, start, cache, tokens.shape[0] - 1)[0]

    def fill(self, tokens: Tensor, start: int, cache: Cache) -> None:
        """``prompt`` without the logits: a chunk of a prompt that goes on."""
        self._read(tokens, start, cache, tokens.shape[0])

    def _read(self, tokens: Tensor, start: int, cache: Cache, logits_from: int) -> Tensor:
        """The rows' logits from ``logits_from`` on, (T - logits_from, V) float32."""
        t = tokens.shape[0]
        if _computing():
            self._fill(start + t)
        columns = torch.arange(start, start + t, dtype=torch.long)  # (T,)
        layers = cache.layers
        keys = [layer.k for layer in layers] * t  # keys[row * L + layer]: one buffer for all rows
        values = [layer.v for layer in layers] * t
        logits = torch.ops.oneblock.decode_step(
            self.step_plan, tokens.contiguous(), columns, columns, torch.zeros(t, dtype=torch.long), keys, values,
            self._rows(t, one_sequence=True), logits_from,
        )  # fmt: skip
        for layer in layers:
            layer.length = start + t  # as ``KVCache.write`` leaves it
        return logits


def _computing() -> bool:
    """Whether a call computes values: not traced by ``torch.compile`` nor run on fake tensors, where the rotary
    tables are not read (a compiled step's caller fills them first, as ``LeanDecode`` does for every position)."""
    return not torch.compiler.is_compiling() and torch._guards.detect_fake_mode() is None
