"""One block as a config wires it, step by step, with the shapes of the current input (B = 1).

The page draws the steps top to bottom; the order of norm, sublayer and residual add is decided here, from
``cfg.norm_position``, the way ``oneblock.layers.block.Block`` runs them.
"""

from __future__ import annotations

from typing import Any

from oneblock.config import ModelConfig

NORM_NAMES = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}


def _ffn_label(cfg: ModelConfig) -> str:
    if cfg.ffn == "swiglu":
        return "SwiGLU feed-forward: W2 (silu(W1 x) * W3 x)"
    return f"MLP feed-forward: W2 {cfg.activation}(W1 x)"


def _sublayer(cfg: ModelConfig, name: str, label: str, t: int, shapes: dict[str, list[int]]) -> dict[str, Any]:
    """Norm, sublayer and residual add, in the order of the config's norm position."""
    norm = {"op": "norm", "label": NORM_NAMES[cfg.norm], "shape": [1, t, cfg.d_model]}
    body = {"op": name, "label": label, "shapes": shapes}
    add = {"op": "add", "label": "+ residual", "shape": [1, t, cfg.d_model]}
    steps = [norm, body, add] if cfg.norm_position == "pre" else [body, add, norm]
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
    attention = "masked self-attention (causal)" if causal else "self-attention (bidirectional)"
    sublayers = [_sublayer(cfg, "self_attention", attention, t, _attention_shapes(cfg, t, t))]
    if s is not None:
        cross = "cross-attention (queries from the decoder, keys and values from the encoder)"
        sublayers.append(_sublayer(cfg, "cross_attention", cross, t, _attention_shapes(cfg, t, s)))
    ffn_shapes = {"x": [1, t, cfg.d_model], "inside": [1, t, cfg.d_ff], "out": [1, t, cfg.d_model]}
    sublayers.append(_sublayer(cfg, "feedforward", _ffn_label(cfg), t, ffn_shapes))
    return {"name": name, "layers": layers, "tokens": t, "causal": causal, "sublayers": sublayers}


def block_diagram(cfg: ModelConfig, t: int, s: int | None = None) -> dict[str, Any]:
    """The block(s) of ``cfg`` for ``t`` tokens (the decoder's ``t`` and the source's ``s`` for an encoder-decoder).

    Returns:
        ``{"norm_position", "norm", "position", "final_norm", "stacks": [...], "head": shape or None}``; each
        stack lists its sublayers, each a list of steps (``norm``, the sublayer with its shapes, ``add``).
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
        "norm": NORM_NAMES[cfg.norm],
        "ffn": cfg.ffn,
        "position": cfg.position,
        "final_norm": cfg.has_final_norm,
        "stacks": stacks,
        "head": None if cfg.arch == "encoder" else [1, t, cfg.vocab_size],
    }
