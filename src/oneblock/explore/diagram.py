"""One block as a config wires it, step by step, with the shapes of the current input (B = 1).

The page draws the steps top to bottom; the order of norm, sublayer and residual add is decided here, from
``cfg.norm_position``, the way ``oneblock.layers.block.Block`` runs them.
"""

from __future__ import annotations

from typing import Any

from oneblock.config import ModelConfig

NORM_NAMES = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
NORM_PLACES = {  # where a block's norms sit, in the words the drawn steps read in
    "pre": "norm before each sublayer",
    "post": "norm after each residual add",
    "sandwich": "norm before and after each sublayer",  # Gemma
    "output": "norm after each sublayer, before its residual add",  # OLMo 2
}


def _ffn_label(cfg: ModelConfig) -> str:
    if cfg.ffn == "swiglu":
        return "SwiGLU feed-forward: W2 (silu(W1 x) * W3 x)"
    if cfg.ffn == "gated":  # GeGLU in Gemma, T5 v1.1
        return f"gated feed-forward: W2 ({cfg.activation}(W1 x) * W3 x)"
    return f"MLP feed-forward: W2 {cfg.activation}(W1 x)"


def _attention_label(cfg: ModelConfig, causal: bool) -> str:
    """The self-attention box, with what the family does inside it (q/k norms, soft-cap, window)."""
    inside = ["causal" if causal else "bidirectional"]
    if cfg.qk_norm:
        inside.append(
            f"{NORM_NAMES[cfg.norm]} on q and k" + (" over the whole width" if cfg.qk_norm_span == "width" else "")
        )
    if cfg.attn_softcap is not None:
        inside.append(f"scores soft-capped at {cfg.attn_softcap:g}")
    if cfg.sliding_window is not None and causal:
        local = sum(1 for i in range(cfg.n_layers) if cfg.is_local(i))
        inside.append(f"window {cfg.sliding_window} in {local} of {cfg.n_layers} layers")
    return f"{'masked ' if causal else ''}self-attention ({'; '.join(inside)})"


def _sublayer(
    cfg: ModelConfig, name: str, label: str, t: int, shapes: dict[str, list[int]], *, branch: bool = True
) -> dict[str, Any]:
    """Norm(s), sublayer and residual add, in the order ``Block`` runs them for the config's norm position.

    ``branch``: the sublayer's output gets the self-attention and feed-forward treatment (the output norm of a
    sandwich or OLMo 2 block, Granite's residual multiplier); cross-attention does not.
    """
    width = [1, t, cfg.d_model]
    norm = {"op": "norm", "label": NORM_NAMES[cfg.norm], "shape": width}
    out_norm = {"op": "norm", "label": f"{NORM_NAMES[cfg.norm]} of the sublayer's output", "shape": width}
    body = {"op": name, "label": label, "shapes": shapes}
    scaled = branch and cfg.residual_multiplier != 1.0
    add = {"op": "add", "label": f"+ residual (output x {cfg.residual_multiplier:g})" if scaled else "+ residual",
           "shape": width}  # fmt: skip
    position = cfg.norm_position if branch or cfg.norm_position == "post" else "pre"
    steps = {
        "pre": [norm, body, add],
        "post": [body, add, norm],
        "sandwich": [norm, body, out_norm, add],  # Gemma: x + norm'(f(norm(x)))
        "output": [body, out_norm, add],  # OLMo 2: x + norm(f(x))
    }[position]
    return {"name": name, "steps": steps}


def _attention_shapes(cfg: ModelConfig, t: int, s: int) -> dict[str, list[int]]:
    return {
        "x": [1, t, cfg.d_model],
        "queries": [1, cfg.n_heads, t, cfg.d_head],
        "keys, values": [1, cfg.n_kv_heads, s, cfg.d_head],
        "weights": [1, cfg.n_heads, t, s],
        "out": [1, t, cfg.d_model],
    }


def _stack(cfg: ModelConfig, name: str, t: int, *, causal: bool, s: int | None, layers: int) -> dict[str, Any]:
    attention = _attention_label(cfg, causal)
    sublayers = [_sublayer(cfg, "self_attention", attention, t, _attention_shapes(cfg, t, t))]
    if s is not None:
        cross = "cross-attention (queries from the decoder, keys and values from the encoder)"
        sublayers.append(_sublayer(cfg, "cross_attention", cross, t, _attention_shapes(cfg, t, s), branch=False))
    ffn_shapes = {"x": [1, t, cfg.d_model], "inside": [1, t, cfg.d_ff], "out": [1, t, cfg.d_model]}
    sublayers.append(_sublayer(cfg, "feedforward", _ffn_label(cfg), t, ffn_shapes))
    return {"name": name, "layers": layers, "tokens": t, "causal": causal, "sublayers": sublayers}


def block_diagram(cfg: ModelConfig, t: int, s: int | None = None) -> dict[str, Any]:
    """The block(s) of ``cfg`` for ``t`` tokens (the decoder's ``t`` and the source's ``s`` for an encoder-decoder).

    Returns:
        ``{"norm_position", "norm_caption" (where the norms sit, in words), "norm", "position", "final_norm",
        "stacks": [...], "head": shape or None}``; each stack lists its sublayers, each a list of steps (``norm``,
        the sublayer with its shapes, ``add``).
    """
    if cfg.arch == "encoder-decoder":
        source = t if s is None else s
        stacks = [
            _stack(cfg, "encoder", source, causal=False, s=None, layers=cfg.n_layers),
            _stack(cfg, "decoder", t, causal=True, s=source, layers=cfg.n_decoder_layers),
        ]
    else:
        stacks = [_stack(cfg, cfg.arch, t, causal=cfg.arch == "decoder", s=None, layers=cfg.n_layers)]
    return {
        "norm_position": cfg.norm_position,
        "norm_caption": f"{NORM_PLACES[cfg.norm_position]} ({NORM_NAMES[cfg.norm]})",
        "norm": NORM_NAMES[cfg.norm],
        "ffn": cfg.ffn,
        "position": cfg.position,
        "final_norm": cfg.has_final_norm,
        "stacks": stacks,
        "head": None if cfg.arch == "encoder" else [1, t, cfg.vocab_size],
    }
