"""The keys every architecture writes, typed as llama.cpp's ``convert_hf_to_gguf.py`` types them, and the options
most of them share (linear rotary scaling, the default query scale): the pieces of each module's ``write``."""

from __future__ import annotations

import math

from oneblock.config import ModelConfig
from oneblock.io.gguf.archs.base import Write, Written
from oneblock.io.gguf.writer import Entry

_U32, _F32, _STR = 4, 6, 8


def u32(key: str, value: int) -> Entry:
    """A ``uint32`` entry."""
    return Entry(key, int(value), _U32)


def f32(key: str, value: float) -> Entry:
    """A ``float32`` entry."""
    return Entry(key, float(value), _F32)


def sizes(
    arch: str, cfg: ModelConfig, *, vocab: bool, rope_dims: bool, head_width: bool, freq_base: bool = True
) -> list[Entry]:
    """The Llama block's sizes under ``arch``: the vocabulary size and rotary width where the converter states them,
    the head width where the Hugging Face config states it (``head_width``) or llama.cpp could not infer it."""
    entries = [u32(f"{arch}.vocab_size", cfg.vocab_size)] if vocab else []
    entries += [
        u32(f"{arch}.context_length", cfg.max_seq_len),
        u32(f"{arch}.embedding_length", cfg.d_model),
        u32(f"{arch}.block_count", cfg.n_layers),
        u32(f"{arch}.feed_forward_length", cfg.d_ff),
        u32(f"{arch}.attention.head_count", cfg.n_heads),
        u32(f"{arch}.attention.head_count_kv", cfg.n_kv_heads),
        f32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.norm_eps),
    ]
    if freq_base:
        entries.append(f32(f"{arch}.rope.freq_base", cfg.rope_theta))
    if rope_dims:
        entries.append(u32(f"{arch}.rope.dimension_count", cfg.rope_dims))
    if head_width or cfg.d_head * cfg.n_heads != cfg.d_model:  # llama.cpp assumes d_model / H unless told
        entries += [u32(f"{arch}.attention.key_length", cfg.d_head), u32(f"{arch}.attention.value_length", cfg.d_head)]
    return entries


def linear_rope(arch: str, cfg: ModelConfig) -> Written:
    """``rope.scaling.type = linear`` and its factor, nothing for plain rotary; any other kind refused."""
    kind = cfg.rope_scaling.get("type")
    if kind is None:
        return Written([], {}, [])
    if kind == "linear":
        factor = float(cfg.rope_scaling["factor"])
        return Written([Entry(f"{arch}.rope.scaling.type", "linear", _STR), f32(f"{arch}.rope.scaling.factor", factor)],
                       {}, [])  # fmt: skip
    return Written([], {}, [f"rope_scaling of type {kind!r} ({arch} files state plain or linear rotary)"])


def default_scale(arch: str, cfg: ModelConfig, scale: float | None = None) -> list[str]:
    """A refusal unless the query scale is the one llama.cpp's ``arch`` uses: ``scale``, or 1/sqrt(Dh)."""
    expected = cfg.d_head**-0.5 if scale is None else scale
    if cfg.attn_scale is None or math.isclose(cfg.attn_scale, expected, rel_tol=1e-6):
        return []
    return [f"attn_scale={cfg.attn_scale} (llama.cpp's {arch} scales scores by {expected:.6g})"]


def plain(arch: str, *, vocab: bool = False, rope_dims: bool = False, head_width: bool = False) -> Write:
    """The ``write`` of an architecture whose options are tensors only (biases, q/k norms, post norms)."""

    def write(cfg: ModelConfig) -> Written:
        rope = linear_rope(arch, cfg)
        keys = sizes(arch, cfg, vocab=vocab, rope_dims=rope_dims, head_width=head_width)
        return Written([*keys, *rope.metadata], {}, [*rope.problems, *default_scale(arch, cfg)])

    return write


def joined(*parts: Written) -> Written:
    """The keys, tensors and refusals of several parts."""
    return Written(
        [e for p in parts for e in p.metadata],
        {k: v for p in parts for k, v in p.tensors.items()},
        [m for p in parts for m in p.problems],
    )
