"""``ob.quantize(model, fmt)``: every linear layer a block matrix, each product within the activation rounding of
``x @ dequantized.T``, the model's predictions those of float32.

The models are GPT-2-shaped (learned positions, LayerNorm, GELU, biases, tied head) and Llama-shaped (RMSNorm,
SwiGLU, rotary, grouped-query heads), with widths that are multiples of 32 (a block) and odd elsewhere.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import oneblock as ob
from oneblock import kernels
from oneblock.errors import InputError
from oneblock.inference.generation import generate
from oneblock.layers.quantized import BlockLinear

pytestmark = pytest.mark.usefixtures("one_thread")

GPT2_STYLE = dict(vocab_size=301, d_model=96, n_heads=3, n_layers=2, d_ff=160, max_seq_len=48)
LLAMA_STYLE = dict(
    GPT2_STYLE, norm="rmsnorm", ffn="swiglu", position="rope", n_heads=6, n_kv_heads=2, bias=False,
    tie_embeddings=False,
)  # fmt: skip


def model_of(sizes: dict, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = ob.build_model(ob.ModelConfig(**sizes)).eval()
    with torch.no_grad():  # larger than the 0.02 init, so the logits are far from uniform
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("sizes", [GPT2_STYLE, LLAMA_STYLE], ids=["gpt2-style", "llama-style"])
@pytest.mark.parametrize("fmt", list(kernels.QUANTIZABLE))
def test_every_linear_layer_becomes_a_block_matrix(sizes, fmt):
    reference = model_of(sizes, seed=1)
    q = ob.quantize(copy.deepcopy(reference), fmt)
    assert not any(isinstance(m, nn.Linear) for m in q.modules())
    assert isinstance(q.lm_head, BlockLinear) and q.lm_head.fmt == fmt
    assert isinstance(q.blocks[0].attn.qkv_proj, BlockLinear)  # q, k, v stacked before quantizing
    if sizes is LLAMA_STYLE:
        assert isinstance(q.blocks[0].ffn.w13, BlockLinear)  # gate and up stacked
    assert torch.equal(q.embed.tok.weight, reference.embed.tok.weight)  # the lookup table stays float
    assert [n for n, p in q.named_parameters() if p.dim() > 1] == ["embed.tok.weight"] + (
        ["embed.pos.weight"] if sizes is GPT2_STYLE else []
    )


@pytest.mark.parametrize("fmt", list(kernels.QUANTIZABLE))
def test_each_product_is_x_times_the_dequantized_matrix(fmt):
    q = ob.quantize(model_of(GPT2_STYLE, seed=2), fmt)
    seen: list[tuple[BlockLinear, torch.Tensor, torch.Tensor]] = []
    hooks = [
        m.register_forward_hook(lambda m, args, out: seen.append((m, args[0], out)))
        for m in q.modules()
        if isinstance(m, BlockLinear)
    ]
    with torch.no_grad():
        q(torch.randint(0, 301, (2, 7), generator=torch.Generator().manual_seed(3)))
    for hook in hooks:
        hook.remove()
    assert len(seen) == 2 * 4 + 1  # qkv, o, w1, w2 in each of the 2 blocks, and the head
    for layer, x, out in seen:
        rows = x.reshape(-1, layer.in_features).double()
        w = layer.dequantized().double()  # (N, K)
        exact = rows @ w.T + (layer.bias.double() if layer.bias is not None else 0)
        # each activation moves by at most half its block's step (max|x_block| / 127); float16 scales ~1e-3
        step = rows.reshape(rows.shape[0], -1, 32).abs().amax(-1) / 127
        bound = (step / 2 * 1.001).repeat_interleave(32, dim=1) @ w.abs().T + 1e-3 * (rows.abs() @ w.abs().T)
        assert ((out.reshape(rows.shape[0], -1).double() - exact).abs() <= bound + 1e-6).all()


def test_q8_0_predicts_what_float32_predicts():
    reference = model_of(GPT2_STYLE, seed=4)
    q = ob.quantize(copy.deepcopy(reference), "q8_0")
    tokens = torch.randint(0, 301, (4, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a, b = reference(tokens), q(tokens)
    agreement = (a.argmax(-1) == b.argmax(-1)).float().mean().item()  # teacher-forced top-1
    # measured 96.25% (154 of 160): a random model's logits hold near-ties that 8-bit activations flip
    assert agreement >= 0.95, agreement
    prompt = tokens[:2, :6]
    assert torch.equal(generate(q, prompt, 8, greedy=True)[:, :6], prompt)  # it decodes, through the lean step


def test_gradients_reach_the_inputs_of_a_quantized_model():
    q = ob.quantize(model_of(LLAMA_STYLE, seed=6), "q4_1")
    hidden = torch.randn(2, 5, 96, requires_grad=True)
    q.logits(hidden).sum().backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all() and hidden.grad.abs().sum() > 0


def test_bad_input_is_refused():
    with pytest.raises(InputError, match=r"quantize expects an nn\.Module; got str"):
        ob.quantize("model", "q8_0")
    with pytest.raises(
        InputError, match=r"unknown block format 'q3_k'; choose one of \['q4_0', 'q4_1', 'q5_0', 'q5_1', 'q8_0'\]"
    ):
        ob.quantize(model_of(GPT2_STYLE, seed=7), "q3_k")


def test_layers_of_widths_that_are_not_whole_blocks_stay_float():
    model = nn.Sequential(nn.Linear(37, 64), nn.Linear(64, 5))
    q = ob.quantize(model, "q8_0")
    assert isinstance(q[0], nn.Linear) and isinstance(q[1], BlockLinear)
