"""How a configuration's block differs from the lesson's, one option at a time, each with its exact parameter cost.

The lesson's block (``get_preset("lesson")``) is the pre-LN decoder block with LayerNorm, an exact-GELU MLP,
learned positions, biases on every linear layer, multi-head attention with ``Dh = C / H`` and a tied head. For each
option in which ``cfg`` departs from it, the row's figure is ``count(cfg) - count(cfg with that option switched
back to the lesson's)``: what that one choice adds (positive) or removes (negative) at this config's sizes. The
rows are measured one by one against ``cfg``, so they need not add up to the difference of the totals (the sizes,
``d_model``, ``d_ff``, ``vocab_size``, ..., differ too, and are not options of the block).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from oneblock.analysis.counting import count_parameters
from oneblock.config import ModelConfig
from oneblock.errors import ConfigError
from oneblock.presets import get_preset

_ACTIVATIONS = {"gelu": "exact GELU", "gelu_tanh": "GELU (tanh approximation)", "relu": "ReLU", "silu": "SiLU"}
_NORMS = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}


@dataclass(frozen=True)
class BlockDifference:
    """One way a config departs from the lesson's block.

    Attributes:
        key: a stable name for the difference (``"norm"``, ``"n_kv_heads"``, ``"bias"``, ...).
        label: what the config does instead, for people.
        parameters: ``count(cfg) - count(cfg.replace(**reverted))``; None when the reverted config cannot exist
            (e.g. ``d_model`` not a multiple of ``n_heads`` without the config's own ``d_head``).
        reverted: the fields that switch this difference back to the lesson's choice.
        note: where the figure comes from, in a few words.
    """

    key: str
    label: str
    parameters: int | None
    reverted: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "label": self.label,
            "parameters": self.parameters,
            "reverted": dict(self.reverted),
            "note": self.note,
        }


def block_differences(cfg: ModelConfig) -> list[BlockDifference]:
    """The rows by which ``cfg``'s block differs from the lesson's, in the lesson's order of the block (wiring,
    norms, feed-forward, positions, attention, head, the details of published checkpoints); empty for the lesson.

    Raises:
        ConfigError: ``cfg`` is not a ``ModelConfig``.
    """
    if not isinstance(cfg, ModelConfig):
        raise ConfigError(f"block_differences expects a ModelConfig; got {type(cfg).__name__}")
    lesson = get_preset("lesson")
    total = count_parameters(cfg).total
    rows: list[BlockDifference] = []

    def add(key: str, label: str, reverted: dict[str, Any], note: str = "") -> None:
        try:
            parameters: int | None = total - count_parameters(cfg.replace(**reverted)).total
        except ConfigError:
            parameters = None
        rows.append(BlockDifference(key, label, parameters, reverted, note))

    for row in _wiring(cfg, lesson) + _layers(cfg, lesson) + _attention(cfg, lesson) + _details(cfg, lesson):
        add(*row)
    return rows


_Row = tuple[str, str, dict[str, Any], str]


def _wiring(cfg: ModelConfig, lesson: ModelConfig) -> list[_Row]:
    rows: list[_Row] = []
    if cfg.arch == "encoder":
        # the pooler exists only in an encoder: it goes back with the wiring
        label = "encoder-only: no causal mask, no LM head" + ("; a pooler tanh(W h_CLS) (BERT)" if cfg.pooler else "")
        rows.append(("arch", label, {"arch": lesson.arch, "pooler": False}, "against the same stack as a decoder"))
    elif cfg.arch == "encoder-decoder":
        label = f"encoder-decoder: an encoder of {cfg.n_layers} blocks, cross-attention in each decoder block"
        rows.append(("arch", label, {"arch": lesson.arch, "n_layers": cfg.n_decoder_layers}, "the encoder's share"))
    if cfg.norm_position != lesson.norm_position:
        label, note = _NORM_POSITIONS[cfg.norm_position]
        rows.append(("norm_position", label, {"norm_position": lesson.norm_position}, note))
    return rows


_NORM_POSITIONS = {
    "post": ("post-LN: a norm after each residual add, none at the end of the stack",
             "pre-LN closes each stack with a final norm"),
    "sandwich": ("sandwich norms: pre-LN plus a norm of each sublayer's output before the add (Gemma)",
                 "two more norms per block"),
    "output": ("norms after the sublayers only: x + norm(f(x)), none before them (OLMo 2)",
               "as many norms as pre-LN, moved"),
}  # fmt: skip


def _layers(cfg: ModelConfig, lesson: ModelConfig) -> list[_Row]:
    rows: list[_Row] = []
    if cfg.norm != lesson.norm:
        note = "no beta: gamma only" if cfg.norm == "rmsnorm" else ""
        rows.append(("norm", f"{_NORMS[cfg.norm]} instead of {_NORMS[lesson.norm]}", {"norm": lesson.norm}, note))
    if cfg.ffn == "mlp" and cfg.activation != lesson.activation:
        label = f"{_ACTIVATIONS[cfg.activation]} instead of {_ACTIVATIONS[lesson.activation]}"
        rows.append(("activation", label, {"activation": lesson.activation}, "an activation has no parameters"))
    if cfg.ffn == "swiglu":  # SwiGLU gates with SiLU whatever `activation` says
        rows.append(("ffn", "SwiGLU feed-forward W2(SiLU(W1 x) * W3 x) instead of a GELU MLP",
                     {"ffn": lesson.ffn, "activation": lesson.activation}, "a third matrix W3"))  # fmt: skip
    elif cfg.ffn == "gated":
        label = "gated feed-forward W2(act(W1 x) * W3 x) instead of an MLP"
        rows.append(("ffn", label, {"ffn": lesson.ffn}, "a third matrix W3"))
        if cfg.activation != lesson.activation:
            label = f"{_ACTIVATIONS[cfg.activation]} instead of {_ACTIVATIONS[lesson.activation]}"
            rows.append(("activation", label, {"activation": lesson.activation}, "an activation has no parameters"))
    if cfg.position != lesson.position:
        label = {
            "rope": f"rotary positions (RoPE, base {_number(cfg.rope_theta)}) instead of a learned table",
            "relative": f"relative position bias ({cfg.relative_buckets} buckets per head, T5) instead of a table",
            "none": "no positions at all instead of a learned table",
        }[cfg.position]
        # a local rotary base needs rotary positions: it goes back with them
        reverted = {"position": lesson.position, **_local_theta_off(cfg)}
        rows.append(("position", label, reverted, "the learned table would be max_seq_len x C"))
    if cfg.rope_scaling:
        rows.append(("rope_scaling", f"rotary frequencies rescaled: {_scaling(cfg.rope_scaling)}",
                     {"rope_scaling": {}}, "a rule on the frequencies, no parameters"))  # fmt: skip
    if cfg.rope_local_theta is not None:
        label = f"local layers rotate with base {_number(cfg.rope_local_theta)} (global: {_number(cfg.rope_theta)})"
        rows.append(("rope_local_theta", label, {"rope_local_theta": None}, "a rotary base has no parameters"))
    if cfg.no_rope_every:
        plain = sum(1 for i in range(cfg.n_layers) if (i + 1) % cfg.no_rope_every == 0)
        label = f"no rotary positions in every {_ordinal(cfg.no_rope_every)} layer ({plain} of {cfg.n_layers})"
        rows.append(("no_rope_every", label, {"no_rope_every": 0}, "leaving rotary out has no parameters"))
    return rows


def _local_theta_off(cfg: ModelConfig) -> dict[str, Any]:
    """``rope_local_theta`` switched off too, where it is set (it needs rotary positions and a window)."""
    return {"rope_local_theta": None} if cfg.rope_local_theta is not None else {}


def _attention(cfg: ModelConfig, lesson: ModelConfig) -> list[_Row]:
    rows: list[_Row] = []
    if cfg.n_kv_heads != cfg.n_heads:
        kind = "multi-query" if cfg.n_kv_heads == 1 else "grouped-query"
        heads = "head" if cfg.n_kv_heads == 1 else "heads"
        label = f"{kind} attention ({cfg.n_kv_heads} key/value {heads} of {cfg.n_heads})"
        rows.append(("n_kv_heads", label, {"n_kv_heads": cfg.n_heads}, "smaller k and v projections"))
    if cfg.n_heads * cfg.d_head != cfg.d_model:
        whole = cfg.d_model % cfg.n_heads == 0
        lesson_width = f"{cfg.d_model // cfg.n_heads}" if whole else f"{cfg.d_model}/{cfg.n_heads}, not whole"
        label = f"head width Dh {cfg.d_head} set apart from C / H = {lesson_width}"
        rows.append(("d_head", label, {"d_head": None}, "q, k, v and o are H x Dh wide"))
    if not (cfg.bias and cfg.qkv_bias):
        label = (
            "biases on q, k and v only (none on the output projection or feed-forward)"
            if cfg.qkv_bias
            else "no biases on q, k and v (the other linear layers keep theirs)"
            if cfg.bias
            else "no biases in the linear layers"
        )
        reverted: dict[str, Any] = {"bias": lesson.bias, "qkv_bias": lesson.qkv_bias}
        rows.append(("bias", label, reverted, "the lesson's linear layers all have biases"))
    if cfg.qk_norm != lesson.qk_norm:
        reverted = {"qk_norm": lesson.qk_norm, "qk_norm_span": lesson.qk_norm_span}
        if cfg.qk_norm_span == "width":
            note = f"(H + H_kv) x Dh = {(cfg.n_heads + cfg.n_kv_heads) * cfg.d_head} gammas per block"
            rows.append(("qk_norm", "RMSNorm over the whole width of q and of k (OLMo 2)", reverted, note))
            label = "q/k norms over the whole width instead of over each head"
            rows.append(("qk_norm_span", label, {"qk_norm_span": lesson.qk_norm_span}, "against 2 x Dh gammas"))
        else:
            rows.append(("qk_norm", "per-head RMSNorm over q and k (Qwen3, Gemma 3)", reverted, "2 x Dh gammas"))
    if cfg.sliding_window is not None:
        local = sum(1 for i in range(cfg.n_layers) if cfg.is_local(i))
        label = f"sliding window {cfg.sliding_window} on {local} of {cfg.n_layers} layers"
        reverted = {"sliding_window": None, "global_every": lesson.global_every, **_local_theta_off(cfg)}
        rows.append(("sliding_window", label, reverted, "a mask has no parameters"))
    if cfg.arch != "encoder" and cfg.tie_embeddings != lesson.tie_embeddings:
        rows.append(("tie_embeddings", "untied LM head", {"tie_embeddings": lesson.tie_embeddings}, "a V x C matrix"))
    return rows


def _details(cfg: ModelConfig, lesson: ModelConfig) -> list[_Row]:
    """The scalars and small tables of published checkpoints."""
    rows: list[_Row] = []
    flags = {
        "attn_scale": _attn_scale(cfg),
        "attn_softcap": f"attention scores soft-capped: tanh(s / {cfg.attn_softcap:g}) x {cfg.attn_softcap:g}"
        if cfg.attn_softcap is not None
        else "",
        "logit_softcap": f"logits soft-capped: tanh(z / {cfg.logit_softcap:g}) x {cfg.logit_softcap:g}"
        if cfg.logit_softcap is not None
        else "",
        "embedding_multiplier": f"token embeddings times {cfg.embedding_multiplier:g} (Granite)",
        "residual_multiplier": f"each sublayer's output times {cfg.residual_multiplier:g} before the add (Granite)",
        "logits_scaling": f"logits divided by {cfg.logits_scaling:g} (Granite)",
        "scale_tied_logits": "the tied head reads h * C^-0.5 (T5)",
        "scale_embeddings": "token embeddings times sqrt(C) (BART, Gemma)",
        "embed_norm": "a norm right after the embeddings (BERT, BART)",
        "type_vocab_size": f"segment embeddings, {cfg.type_vocab_size} rows (BERT)",
        "position_offset": f"the position table offset by {cfg.position_offset} rows (BART)",
        "final_logits_bias": "a bias added to the logits (BART), a buffer rather than a parameter",
    }
    scalars = ("attn_softcap", "logit_softcap", "embedding_multiplier", "residual_multiplier", "logits_scaling")
    for name, label in flags.items():
        if getattr(cfg, name) != getattr(lesson, name):
            note = "a scalar, no parameters" if name in scalars else ""
            rows.append((name, label, {name: getattr(lesson, name)}, note))
    return rows


def _attn_scale(cfg: ModelConfig) -> str:
    if cfg.attn_scale is None:
        return ""
    if abs(cfg.attn_scale - cfg.d_head**-0.5) <= 1e-12 * cfg.attn_scale:
        return f"scores scaled by a stated {cfg.attn_scale:g} (equal to 1/sqrt(Dh) here)"
    return f"scores scaled by {cfg.attn_scale:g} instead of 1/sqrt(Dh)"


def _ordinal(n: int) -> str:
    """``2nd``, ``4th``, ``11th``, ``21st``."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _number(value: float) -> str:
    """``500,000`` for 5e5, ``0.5`` for 0.5."""
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


def _scaling(scaling: dict[str, Any]) -> str:
    kind = scaling["type"]
    if kind == "factors":
        return f"a GGUF file's {len(scaling['factors'])} per-frequency factors"
    if kind == "longrope":
        return (
            f"LongRoPE ({len(scaling['short_factors'])} short and long per-frequency factors, original context "
            f"{_number(scaling['original_max_position_embeddings'])}, attention_factor "
            f"{_number(scaling['attention_factor'])})"
        )
    rest = ", ".join(
        f"{len(v)} per-frequency {k}" if isinstance(v, list) else f"{k} {_number(v)}"
        for k, v in scaling.items()
        if k != "type"
    )
    return f"{kind} ({rest})"
