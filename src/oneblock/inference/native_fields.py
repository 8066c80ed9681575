"""A decoder's tensors gathered by name into the native step's fields
(:class:`oneblock.kernels.decode_step.StepFields`): block matrices as the file's bytes, float weights as they are,
each layer's options and the adapters' updates; a part the step does not compute is refused by name
(:class:`Unsupported`). :class:`oneblock.inference.native_step.NativeStep` builds its plan from them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from oneblock.adapters.multi import AdapterRows, MultiLoraLinear
from oneblock.kernels import decode_step
from oneblock.layers.attention import MultiHeadAttention
from oneblock.layers.block import Block
from oneblock.layers.feedforward import FeedForward
from oneblock.layers.norms import LayerNorm, RMSNorm
from oneblock.layers.quantized import BlockEmbedding, BlockLinear
from oneblock.models.decoder import Decoder

_NORMS: dict[type[nn.Module], int] = {LayerNorm: 0, RMSNorm: 1}
_ACTIVATIONS = {"gelu": 0, "gelu_tanh": 1, "relu": 2, "silu": 3}
_POSITIONS = {"none": 0, "learned": 1, "rope": 2}


class Unsupported(Exception):
    """A part of the model the native step does not compute (``NativeStep.of`` answers ``None``)."""


def _floats(t: Tensor) -> Tensor:
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise Unsupported(f"{t.dtype} weights on {t.device} (it reads float32 on the CPU)")
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
    raise Unsupported(f"a {type(module).__name__} layer")


class Adapters:
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
            raise Unsupported("adapted layers that read different AdapterRows")
        self.rows = module.rows
        for k, scale in module.scales.items():
            a, b = _floats(getattr(module, f"lora_A_{k}")), _floats(getattr(module, f"lora_B_{k}"))
            self.updates.append(decode_step.LoraUpdate(layer, name, k, scale, a, b))
        return _matrix(module.base)


def _norm(module: nn.Module | None, kind: int | None, eps: float | None) -> tuple[int, float, Tensor, Tensor | None]:
    """``(kind, eps, weight, bias)`` of a norm, the same kind and eps as the others of the model."""
    if not isinstance(module, (LayerNorm, RMSNorm)) or type(module) not in _NORMS:
        raise Unsupported(f"a norm {type(module).__name__}")
    found = _NORMS[type(module)]
    if (kind is not None and found != kind) or (eps is not None and module.eps != eps):
        raise Unsupported("norms of different kinds or eps in one model")
    bias = module.bias if isinstance(module, LayerNorm) else None
    return found, float(module.eps), _floats(module.weight), bias


def gather(model: Decoder) -> tuple[decode_step.StepFields, Adapters]:
    """``model``'s tensors by name, without copies, and its adapters' updates.

    Raises:
        Unsupported: a part the native step does not compute, named.
    """
    cfg, embed = model.config, model.embed
    if embed.segment is not None or embed.norm is not None or cfg.scale_tied_logits:
        raise Unsupported("segmented or normalized embeddings, or a scaled head")
    if cfg.position not in _POSITIONS or model.final_logits_bias is not None:
        raise Unsupported(f"positions {cfg.position!r}")
    tensors: dict[str, Tensor] = {}
    formats: dict[str, int] = {}
    tok = embed.tok
    if type(tok) is BlockEmbedding and tok.blocks.device.type == "cpu":
        tensors["tok"], formats["tok"] = tok.blocks, tok.ggml_type
    elif type(tok) is nn.Embedding:
        tensors["tok"] = _floats(tok.weight)
    else:
        raise Unsupported(f"a {type(tok).__name__} token table")
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
    adapters = Adapters()
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
            raise Unsupported("a block with other attention or feed-forward modules")
        if (block.attn.scale, block.attn.softcap) != (attn.scale, attn.softcap):
            raise Unsupported("blocks with different attention scales or soft caps")
        if block.residual_multiplier != first.residual_multiplier:
            raise Unsupported("blocks with different residual multipliers")
        if block.attn.local_rope and "rope_local_cos" not in tensors:
            raise Unsupported("local rotary tables without rotary positions")
        layer: dict[str, Tensor] = {}
        fmts: dict[str, int] = {}
        if out_norm == 2:  # output norms alone: nothing before the sublayers
            if type(block.attn_norm) is not nn.Identity or type(block.ffn_norm) is not nn.Identity:
                raise Unsupported("blocks with and without norms before their sublayers in one model")
        else:
            for name, module in (("attn_norm", block.attn_norm), ("ffn_norm", block.ffn_norm)):
                kind, eps, w, b = _norm(module, kind, eps)
                _put(layer, f"{name}_w", w)
                _put(layer, f"{name}_b", b)
        kind, eps = _options(block, out_norm, qk_norm, kind, eps, layer)
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
        raise Unsupported("a model without norms")
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
        raise Unsupported("blocks with different options (q/k norms, norms of the outputs) in one model")
    if block.attn_out_norm is not None:
        for name, module in (("attn_out_norm", block.attn_out_norm), ("ffn_out_norm", block.ffn_out_norm)):
            kind, eps, w, b = _norm(module, kind, eps)
            _put(layer, f"{name}_w", w)
            _put(layer, f"{name}_b", b)
    if a.q_norm is not None and a.k_norm is not None:
        norms = (a.q_norm, a.k_norm)
        if any(type(n) is not RMSNorm or n.eps != eps for n in norms):
            raise Unsupported("q/k norms other than RMSNorms with the model's eps")
        _put(layer, "q_norm_w", a.q_norm.weight)
        _put(layer, "k_norm_w", a.k_norm.weight)
    return kind, eps
