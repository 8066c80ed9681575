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

:class:`NativeStep` gathers the model's own tensors once per generation (no copies: block matrices as the file's
bytes, float weights as they are) into named fields (:class:`oneblock.kernels.decode_step.StepFields`) and builds
from them the ``StepPlan`` that every call passes: the plan checks the tensors once, a call only its rows.
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

import math
import os
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from oneblock import kernels
from oneblock.adapters.multi import AdapterRows, MultiLoraLinear
from oneblock.errors import ConfigError
from oneblock.kernels import decode_step
from oneblock.kernels.tiles import int8_prompts
from oneblock.layers.attention import MultiHeadAttention
from oneblock.layers.block import Block
from oneblock.layers.feedforward import FeedForward
from oneblock.layers.kv_cache import Cache
from oneblock.layers.norms import LayerNorm, RMSNorm
from oneblock.layers.quantized import BlockEmbedding, BlockLinear
from oneblock.layers.rotary import RotaryEmbedding
from oneblock.models.decoder import Decoder

ENV = "ONEBLOCK_NATIVE_STEP"
"""Set to ``0`` to decode with the Python step even where the native one applies."""

_NORMS: dict[type[nn.Module], int] = {LayerNorm: 0, RMSNorm: 1}
_ACTIVATIONS = {"gelu": 0, "gelu_tanh": 1, "relu": 2, "silu": 3}
_POSITIONS = {"none": 0, "learned": 1, "rope": 2}
CACHE_DTYPES = (torch.float32, torch.float16)
"""The key/value caches the native step reads (a float16 one rounded as stored, to nearest even, widened as read)."""
_NO_ROWS = torch.empty(0, dtype=torch.long)  # the rows' adapters, without adapters


class _Unsupported(Exception):
    """A part of the model the native step does not compute (internal: ``NativeStep.of`` answers ``None``)."""


def enabled() -> bool:
    """Whether the native step may run: ``ONEBLOCK_NATIVE_STEP`` is not ``0`` and the C++ op exists."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    return kernels.backend() != "torch" and decode_step.defined()


def _floats(t: Tensor) -> Tensor:
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise _Unsupported(f"{t.dtype} weights on {t.device} (it reads float32 on the CPU)")
    return t.detach().contiguous()


def _put(tensors: dict[str, Tensor], name: str, t: Tensor | None) -> None:
    """``tensors[name]`` = ``t`` (float32 on the CPU), where the model has it."""
    if t is not None:
        tensors[name] = _floats(t)


def _matrix(module: nn.Module | None) -> tuple[Tensor, int, Tensor | None]:
    """``(weight, format, bias)`` of a plain float32 ``nn.Linear`` (format 0) or a ``BlockLinear``."""
    if type(module) is BlockLinear and module.blocks.device.type == "cpu":
        return module.blocks, module.ggml_type, module.bias
    if type(module) is nn.Linear:
        return _floats(module.weight), 0, module.bias
    raise _Unsupported(f"a {type(module).__name__} layer")


class _Adapters:
    """The LoRA updates of a model's ``MultiLoraLinear`` layers, by layer and matrix (``csrc/decode_step.h``)."""

    def __init__(self) -> None:
        self.rows: AdapterRows | None = None  # shared by every layer: ``load_adapters`` made one
        self.updates: list[decode_step.LoraUpdate] = []

    def matrix(self, module: nn.Module | None, layer: int, name: str) -> tuple[Tensor, int, Tensor | None]:
        """``_matrix`` of a layer, or of a ``MultiLoraLinear``'s base, whose updates are recorded for matrix
        ``name`` of layer ``layer``."""
        if type(module) is not MultiLoraLinear:
            return _matrix(module)
        if self.rows is not None and module.rows is not self.rows:
            raise _Unsupported("adapted layers that read different AdapterRows")
        self.rows = module.rows
        for k, scale in module.scales.items():
            a, b = _floats(getattr(module, f"lora_A_{k}")), _floats(getattr(module, f"lora_B_{k}"))
            self.updates.append(decode_step.LoraUpdate(layer, name, k, scale, a, b))
        return _matrix(module.base)


def _norm(module: nn.Module | None, kind: int | None, eps: float | None) -> tuple[int, float, Tensor, Tensor | None]:
    """``(kind, eps, weight, bias)`` of a norm, the same kind and eps as the others of the model."""
    if not isinstance(module, (LayerNorm, RMSNorm)) or type(module) not in _NORMS:
        raise _Unsupported(f"a norm {type(module).__name__}")
    found = _NORMS[type(module)]
    if (kind is not None and found != kind) or (eps is not None and module.eps != eps):
        raise _Unsupported("norms of different kinds or eps in one model")
    bias = module.bias if isinstance(module, LayerNorm) else None
    return found, float(module.eps), _floats(module.weight), bias


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
            fields, adapters = cls._gather(model)
        except _Unsupported as error:
            return f"the native step does not compute {error}"
        return cls(fields, adapters.rows, [rope for rope in (model.rope, model.rope_local) if rope is not None])

    @classmethod
    def _gather(cls, model: Decoder) -> tuple[decode_step.StepFields, _Adapters]:
        cfg, embed = model.config, model.embed
        if embed.segment is not None or embed.norm is not None or cfg.scale_tied_logits:
            raise _Unsupported("segmented or normalized embeddings, or a scaled head")
        if cfg.position not in _POSITIONS or model.final_logits_bias is not None:
            raise _Unsupported(f"positions {cfg.position!r}")
        tensors: dict[str, Tensor] = {}
        formats: dict[str, int] = {}
        tok = embed.tok
        if type(tok) is BlockEmbedding and tok.blocks.device.type == "cpu":
            tensors["tok"], formats["tok"] = tok.blocks, tok.ggml_type
        elif type(tok) is nn.Embedding:
            tensors["tok"] = _floats(tok.weight)
        else:
            raise _Unsupported(f"a {type(tok).__name__} token table")
        _put(tensors, "pos", embed.pos.weight if embed.pos is not None else None)
        if model.rope is not None:
            _put(tensors, "rope_cos", model.rope.cos)
            _put(tensors, "rope_sin", model.rope.sin)
            if model.rope_local is not None:
                _put(tensors, "rope_local_cos", model.rope_local.cos)
                _put(tensors, "rope_local_sin", model.rope_local.sin)
        kind: int | None = None
        eps: float | None = None
        if model.final_norm is not None:
            kind, eps, final_w, final_b = _norm(model.final_norm, kind, eps)
            _put(tensors, "final_norm_w", final_w)
            _put(tensors, "final_norm_b", final_b)
        head_w, head_format, head_b = _matrix(model.lm_head)
        tensors["head_w"] = head_w
        _put(tensors, "head_b", head_b)
        if head_format:
            formats["head_w"] = head_format
        adapters = _Adapters()
        first = model.block(0)
        attn = first.attn
        out_norm = 0 if first.attn_out_norm is None else 2 if type(first.attn_norm) is nn.Identity else 1
        qk_norm = 0 if attn.q_norm is None else 2 if attn.qk_norm_span == "width" else 1
        layers: list[dict[str, Tensor]] = []
        layer_formats: list[dict[str, int]] = []
        layer_sizes: list[dict[str, int]] = []
        for i in range(len(model.blocks)):
            block = model.block(i)
            if type(block.attn) is not MultiHeadAttention or type(block.ffn) is not FeedForward:
                raise _Unsupported("a block with other attention or feed-forward modules")
            if (block.attn.scale, block.attn.softcap) != (attn.scale, attn.softcap):
                raise _Unsupported("blocks with different attention scales or soft caps")
            if block.residual_multiplier != first.residual_multiplier:
                raise _Unsupported("blocks with different residual multipliers")
            if block.attn.local_rope and "rope_local_cos" not in tensors:
                raise _Unsupported("local rotary tables without rotary positions")
            layer: dict[str, Tensor] = {}
            fmts: dict[str, int] = {}
            if out_norm == 2:  # output norms alone: nothing before the sublayers
                if type(block.attn_norm) is not nn.Identity or type(block.ffn_norm) is not nn.Identity:
                    raise _Unsupported("blocks with and without norms before their sublayers in one model")
            else:
                for name, module in (("attn_norm", block.attn_norm), ("ffn_norm", block.ffn_norm)):
                    kind, eps, w, b = _norm(module, kind, eps)
                    _put(layer, f"{name}_w", w)
                    _put(layer, f"{name}_b", b)
            kind, eps = cls._options(block, out_norm, qk_norm, kind, eps, layer)
            a, ffn = block.attn, block.ffn
            matrices: dict[str, nn.Module | None] = (
                {"q_w": a.qkv_proj} if a.qkv_proj is not None else {"q_w": a.q_proj, "k_w": a.k_proj, "v_w": a.v_proj}
            )
            matrices["o_w"] = a.o_proj
            if ffn.w13 is not None:  # gate and up stacked
                matrices["gate_w"] = ffn.w13
            else:
                matrices["gate_w"] = ffn.w1  # or the MLP's first matrix
                if ffn.kind != "mlp":
                    matrices["up_w"] = ffn.w3
            matrices["down_w"] = ffn.w2
            for name, part in matrices.items():  # each with its adapters' updates
                weight, fmt, bias = adapters.matrix(part, i, name)
                layer[name] = weight
                _put(layer, name[:-1] + "b", bias)
                if fmt:
                    fmts[name] = fmt
            layers.append(layer)
            layer_formats.append(fmts)
            rope = 0 if model.rope is None or not a.use_rope else 2 if a.local_rope else 1  # none, global, local
            layer_sizes.append({"window": a.window or 0, "rope": rope})
        if kind is None or eps is None:
            raise _Unsupported("a model without norms")
        act = "silu" if cfg.ffn == "swiglu" else cfg.activation
        sizes = {
            "d_model": cfg.d_model, "n_heads": attn.n_heads, "n_kv_heads": attn.n_kv_heads, "d_head": attn.d_head,
            "d_ff": cfg.d_ff, "vocab": cfg.vocab_size, "norm": kind, "ffn": 0 if cfg.ffn == "mlp" else 1,
            "activation": _ACTIVATIONS[act], "position": _POSITIONS[cfg.position], "position_offset": embed.offset,
            "final_norm": int(model.final_norm is not None), "out_norm": out_norm, "qk_norm": qk_norm,
        }  # fmt: skip
        scalars = {
            "norm_eps": eps,
            "attn_scale": attn.scale if attn.scale is not None else 1.0 / math.sqrt(attn.d_head),
            "embed_scale": embed.scale,
            "attn_softcap": attn.softcap or 0.0,  # 0: none
            "logit_softcap": cfg.logit_softcap or 0.0,
            "residual_multiplier": first.residual_multiplier,  # 1: none
            "logits_scaling": cfg.logits_scaling,  # 1: none
        }
        fields = decode_step.StepFields(
            sizes, scalars, tensors, layer_sizes, layers, formats, layer_formats, adapters.updates
        )
        return fields, adapters

    @staticmethod
    def _options(
        block: Block, out_norm: int, qk_norm: int, kind: int | None, eps: float | None, layer: dict[str, Tensor]
    ) -> tuple[int | None, float | None]:
        """A layer's option tensors into ``layer``: q_norm_w, k_norm_w (RMSNorms with the model's eps, per head or
        over the width), attn_out_norm_w/_b, ffn_out_norm_w/_b (the norms of the sublayers' outputs), where the
        block has them. Returns the model's norm kind and eps (the output norms' where no norm was seen before)."""
        a = block.attn
        has_out = 0 if block.attn_out_norm is None else 2 if type(block.attn_norm) is nn.Identity else 1
        has_qk = 0 if a.q_norm is None else 2 if a.qk_norm_span == "width" else 1
        if (has_qk, has_out) != (qk_norm, out_norm):
            raise _Unsupported("blocks with different options (q/k norms, norms of the outputs) in one model")
        if block.attn_out_norm is not None:
            for name, module in (("attn_out_norm", block.attn_out_norm), ("ffn_out_norm", block.ffn_out_norm)):
                kind, eps, w, b = _norm(module, kind, eps)
                _put(layer, f"{name}_w", w)
                _put(layer, f"{name}_b", b)
        if a.q_norm is not None and a.k_norm is not None:
            norms = (a.q_norm, a.k_norm)
            if any(type(n) is not RMSNorm or n.eps != eps for n in norms):
                raise _Unsupported("q/k norms other than RMSNorms with the model's eps")
            _put(layer, "q_norm_w", a.q_norm.weight)
            _put(layer, "k_norm_w", a.k_norm.weight)
        return kind, eps

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
