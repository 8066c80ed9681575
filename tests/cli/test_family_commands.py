"""``oneblock trace`` and ``oneblock check`` on every decoder family oneblock loads, from the Hugging Face directory
and from llama.cpp's F32 conversion of it (``converter_testing.made``), against transformers' model of the same
directory: the traced parameter counts are transformers' numel, module by module, with each family's norms in
the block; the checks' figures are those of transformers' forward on the same tokens.
"""

from __future__ import annotations

import json

import pytest
import torch
from converter_testing import FAMILIES, made
from torch import nn

from oneblock.cli.main import main

pytestmark = pytest.mark.usefixtures("one_thread")
SOURCES = {"hf": lambda directory: directory, "gguf": lambda directory: directory / "f32.gguf"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    """(directory of the family's files, transformers' model of it with eager attention)."""
    import transformers

    directory = made(request.param)
    config = transformers.AutoConfig.from_pretrained(directory)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type") == "longrope":
        # oneblock opens the files at their full context, where LongRoPE runs its long factors at every length (as
        # llama.cpp does for an n_ctx beyond the original); transformers takes them only for a sequence longer than
        # the original context, and the check's sequences are shorter
        rope["short_factor"] = list(rope["long_factor"])
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        directory, config=config, attn_implementation="eager"
    ).eval()
    return directory, reference


def run_json(capsys, *argv: str) -> dict:
    code = main([*argv, "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0, data
    return data


def numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # a tied matrix is one Parameter, counted once


def norms(module: nn.Module) -> list[nn.Module]:
    """``module``'s own norm layers (not those inside its children)."""
    return [m for m in module.children() if "Norm" in type(m).__name__ and numel(m)]


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_trace_counts_transformers_parameters_module_by_module(family, source, capsys):
    directory, reference = family
    hf = reference.config
    data = run_json(capsys, "trace", "--model", str(SOURCES[source](directory)), "--batch", "2", "--seq-len", "5")
    rows = {r["module"]: r for r in data["rows"]}
    assert rows["model"]["parameters"] == numel(reference)
    assert rows["model"]["outputs"] == [[2, 5, hf.vocab_size]]
    assert rows["embed.tok"]["parameters"] == numel(reference.model.embed_tokens)
    layers = reference.model.layers
    assert [rows[f"blocks.{i}"]["parameters"] for i in range(len(layers))] == [numel(layer) for layer in layers]
    assert f"blocks.{len(layers)}" not in rows
    block = [r for r in data["rows"] if r["module"].count(".") == 2 and r["module"].startswith("blocks.0.")]
    ours = [r["parameters"] for r in block if r["kind"] == "RMSNorm"]  # Gemma's four, OLMo 2's two after
    assert sorted(ours) == sorted(numel(m) for m in norms(layers[0]))
    inside = [
        r["parameters"] for r in data["rows"] if r["module"].startswith("blocks.0.attn.") and "norm" in r["module"]
    ]
    assert sorted(inside) == sorted(numel(m) for m in norms(layers[0].self_attn))  # Qwen3, Gemma 3, OLMo 2
    d_head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert rows["blocks.0.attn.q_proj"]["outputs"] == [[2, 5, hf.num_attention_heads * d_head]]
    assert rows["blocks.0.attn.k_proj"]["outputs"] == [[2, 5, hf.num_key_value_heads * d_head]]
    assert rows["blocks.0.ffn.w2"]["inputs"] == [[2, 5, hf.intermediate_size]]


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_check_figures_are_transformers_forward(family, source, capsys):
    directory, reference = family
    hf = reference.config
    data = run_json(capsys, "check", "--model", str(SOURCES[source](directory)), "--seed", "3")
    checks = {c["name"]: c for c in data["checks"]}
    assert data["passed"] and all(c["passed"] for c in data["checks"])
    shape = [2, hf.num_attention_heads, 4, 4]  # (B, H, T, T) of the check's two rows of four tokens
    assert checks["attention shape"]["figures"]["shapes"] == [shape] * hf.num_hidden_layers
    tokens = torch.randint(0, hf.vocab_size, (2, 4), generator=torch.Generator().manual_seed(3))
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % hf.vocab_size
    with torch.no_grad():  # the model's whole output: soft-caps, multipliers and scalings included
        moved = float((reference(tokens).logits - reference(changed).logits)[:, -1].abs().max())
    figures = checks["causality"]["figures"]
    assert figures["earlier_max_change"] == 0.0
    assert figures["last_max_change"] == pytest.approx(moved, rel=1e-4)
    g = torch.Generator().manual_seed(0)  # the probe of the first feed-forward network: position 2 of 5 changed
    x = torch.randn(1, 5, hf.hidden_size, generator=g)
    y = x.clone()
    y[:, 2] = torch.randn(hf.hidden_size, generator=g)
    with torch.no_grad():
        mlp = reference.model.layers[0].mlp  # Gemma's GeGLU, Phi-3's stacked gate and up
        want = float((mlp(x) - mlp(y))[:, 2].abs().max())
    figures = checks["feed-forward is position-wise"]["figures"]
    assert figures["others_max_change"] == 0.0
    assert figures["changed_position_max_change"] == pytest.approx(want, rel=1e-5)
    # cached decoding past the window (24 in Gemma's and Phi-3's files): each local layer's ring wraps
    window = getattr(hf, "sliding_window", None)
    local = sum(kind == "sliding_attention" for kind in getattr(hf, "layer_types", None) or ["sliding_attention"] * 3)
    figures = checks["cached decoding equals the full pass"]["figures"]
    assert figures["positions"] == (8 if window is None else window + 8)
    assert (figures["ring_layers"], figures["ring_capacity"]) == ((0, None) if window is None else (local, window))
    assert figures["max_error"] <= figures["atol"] <= 1e-4
