"""The native decode step computes the block's options as the Python step does: per-head q/k norms (Qwen3),
sandwich norms, a gated GELU, scaled embeddings, a score scale, soft-capped scores and logits, sliding windows
on local layers and local rotary tables (Gemma 2 and 3); scaled residual branches and logits (Granite); layers
without rotary (SmolLM3); output norms and q/k norms over the width (OLMo 2); partial rotary (Phi-4-mini); alone
and together.

Float32 weights with every parameter (norm weights included) moved away from its initial value: logits within
1e-5 of their scale over more tokens than the window holds, for one row and a left-padded batch; the prompt read
in one native call; the batched decoder's staggered slots; generation taking the native step.
"""

from __future__ import annotations

import pytest
import torch
from native_testing import SMALL, build_from, decode_across_threads_and_isas, decode_both, relative

from oneblock import kernels
from oneblock.inference.batch import BatchDecoder
from oneblock.inference.generation import generate
from oneblock.inference.native_step import NativeStep

pytestmark = pytest.mark.skipif(kernels.backend() == "torch", reason="the native step needs the C++ library")

LLAMA = {"norm": "rmsnorm", "ffn": "swiglu", "position": "rope", "n_heads": 6, "n_kv_heads": 2, "bias": False}
GEMMA = {**LLAMA, "ffn": "gated", "activation": "gelu_tanh", "norm_position": "sandwich", "scale_embeddings": True}
LOCAL = {"sliding_window": 4, "global_every": 2}  # layer 0 local, layer 1 global
OPTIONS = {
    "qk_norm": {**LLAMA, "qk_norm": True, "norm_eps": 1e-6},
    "sandwich": {**LLAMA, "norm_position": "sandwich"},
    "sandwich-layernorm": {"norm_position": "sandwich", "activation": "gelu_tanh"},  # biases on the extra norms
    "geglu": {**LLAMA, "ffn": "gated", "activation": "gelu_tanh"},
    "scaled-embeddings": {**LLAMA, "scale_embeddings": True},
    "attn-scale": {**LLAMA, "attn_scale": 0.3},
    "attn-softcap": {**LLAMA, "attn_softcap": 1.5},
    "logit-softcap": {**LLAMA, "logit_softcap": 2.0},
    "sliding-window": {**LLAMA, **LOCAL},
    "learned-positions-window": {**LOCAL, "activation": "gelu_tanh"},
    "local-rope": {**LLAMA, **LOCAL, "rope_local_theta": 100.0},
    "gemma2": {**GEMMA, **LOCAL, "attn_softcap": 1.5, "logit_softcap": 2.0, "attn_scale": 0.25},
    "gemma3": {**GEMMA, **LOCAL, "qk_norm": True, "rope_local_theta": 100.0, "norm_eps": 1e-6},
    "residual-multiplier": {**LLAMA, "residual_multiplier": 0.4},
    "logits-scaling": {**LLAMA, "logits_scaling": 3.0},
    "no-rope-layers": {**LLAMA, "no_rope_every": 2},  # layer 1 without rotary
    "output-norms": {**LLAMA, "norm_position": "output"},
    "output-norms-layernorm": {"norm_position": "output", "activation": "gelu_tanh"},  # biases on the norms
    "width-qk-norm": {**LLAMA, "qk_norm": True, "qk_norm_span": "width", "norm_eps": 1e-6},
    "partial-rotary": {**LLAMA, "rope_dims": 4},  # 4 of each head's 6 features rotate
    "olmo2": {**LLAMA, "norm_position": "output", "qk_norm": True, "qk_norm_span": "width", "norm_eps": 1e-6},
    "granite": {
        **LLAMA, "embedding_multiplier": 6.0, "residual_multiplier": 0.22, "logits_scaling": 8.0, "attn_scale": 0.3,
    },
    "smollm3-phi4": {**LLAMA, **LOCAL, "no_rope_every": 2, "rope_dims": 2, "logit_softcap": 2.0},
}  # fmt: skip
PROMPTS = [[[5, 17, 3, 99, 42]], [[5, 17, 3, 99, 42], [7, 8], [60, 61, 62]]]  # one row; left-padded rows


WIDE_HEADS = {**SMALL, "d_model": 96}  # heads of 16 or 32 features: their group attends together (attend_avx2.cpp)


def build(option: str, seed: int = 0, sizes: dict | None = None) -> torch.nn.Module:
    return build_from(OPTIONS[option], sizes or SMALL, seed)


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("prompts", PROMPTS)
def test_native_logits_equal_the_python_step(option, prompts):
    native, python = decode_both(build(option), prompts, steps=12)  # 12 steps: past the window of 4
    assert relative(native, python) <= 1e-5
    assert torch.equal(native.argmax(-1), python.argmax(-1))


@pytest.mark.parametrize("option", OPTIONS)
def test_heads_attending_together_equal_the_python_step(option):
    """Heads of a multiple of 8 features take the grouped attention where the CPU has AVX2: the same logits
    within 1e-5, past the window (the ring wraps), on 1 and 2 threads alike and against the scalar twin."""
    model = build(option, sizes=WIDE_HEADS)
    assert all(block.attn.d_head % 8 == 0 for block in model.blocks)
    # logits soft-capped at 2 are a small scale: the per-head path's own error measures 2.2e-5 of it there
    bound = 5e-5 if "logit_softcap" in OPTIONS[option] else 1e-5
    native, python = decode_both(model, PROMPTS[1], steps=12)
    assert relative(native, python) <= bound
    assert torch.equal(native.argmax(-1), python.argmax(-1))
    scalar, python = decode_across_threads_and_isas(model, PROMPTS[1], steps=12)
    assert relative(scalar, python) <= bound


@pytest.mark.parametrize("option", ["sliding-window", "gemma2", "qk_norm"])
def test_heads_weighed_with_avx512_equal_the_avx2_path_bit_for_bit(option):
    """Where the block kernels run AVX-512, a group's values are weighed for all its heads at once (heads of 16 and
    32 features here): the logits equal those of the AVX2 path bit for bit, on a CPU without AVX-512 trivially."""
    model = build(option, sizes=WIDE_HEADS)
    isa = torch.ops.oneblock.isa()
    supported = torch.ops.oneblock.isa_supported
    wide = [name for name in ("avx512", "avx512_vnni") if supported(kernels.ops.ISAS.index(name))]
    try:
        kernels.ops.set_isa("avx2")
        narrow, _ = decode_both(model, PROMPTS[1], steps=12)
        for name in wide:
            kernels.ops.set_isa(name)
            assert torch.equal(decode_both(model, PROMPTS[1], steps=12)[0], narrow), name
    finally:
        kernels.ops.set_isa(isa)


@pytest.mark.parametrize("option", ["sliding-window", "gemma2", "gemma3"])
def test_the_window_changes_the_logits(option):
    """The local layer's window matters to these models: without it the logits differ (so the test above sees it)."""
    model = build(option, seed=1)
    wide = build(option, seed=1)
    for block in wide.blocks:
        block.attn.window = None
    feed = [[9]] * 12
    native, _ = decode_both(model, [[5, 17, 3]], steps=12, feed=feed)
    unwindowed, _ = decode_both(wide, [[5, 17, 3]], steps=12, feed=feed)
    assert relative(native[:2], unwindowed[:2]) <= 1e-5  # 3 and 4 tokens, within the window: the same
    assert relative(native[-1], unwindowed[-1]) > 1e-3


@pytest.mark.parametrize(
    "option", ["qk_norm", "sandwich-layernorm", "local-rope", "gemma2", "gemma3", "olmo2", "granite", "smollm3-phi4"]
)
@pytest.mark.parametrize("start", [0, 5])  # an empty cache; five positions already in it
def test_the_native_prompt_read_equals_the_python_forward(option, start):
    model = build(option, seed=3)
    ids = [5, 17, 3, 99, 42, 7, 8, 60, 61, 62, 11]
    plan = NativeStep.of(model)
    assert plan is not None
    ours, theirs = (model.new_cache(1, max_len=20, chunk=20) for _ in range(2))
    with torch.inference_mode():
        if start:
            for cache in (ours, theirs):
                model.run(torch.tensor([ids[:start]]), cache=cache)
        want = model.logits(model.run(torch.tensor([ids[start:]]), cache=theirs)[:, -1])[0]  # (V,)
        got = plan.prompt(torch.tensor(ids[start:]), start, ours)
    assert relative(got, want) <= 1e-5
    for a, b in zip(ours.layers, theirs.layers, strict=True):  # the keys (normalized, rotated) every row stored
        assert relative(a.k[:, :, : len(ids)], b.k[:, :, : len(ids)]) <= 1e-5
        assert relative(a.v[:, :, : len(ids)], b.v[:, :, : len(ids)]) <= 1e-5


@pytest.mark.parametrize("option", ["gemma2", "gemma3", "olmo2", "granite"])
def test_batched_decoder_with_staggered_slots_matches_its_python_step(option):
    model = build(option, seed=2)
    native, python = BatchDecoder(model), BatchDecoder(model, native=False)
    assert native.native is not None and python.native is None
    slots: list[list] = [[], []]
    fed: list[int] = []
    for step in range(12):
        if step in (0, 3):  # a request joins between steps, at its own column
            ids = [[5, 17, 3, 99, 42, 7], [60, 61]][(0, 3).index(step)]
            for decoder, active in zip((native, python), slots, strict=True):
                slot, logits = decoder.prefill(ids, max_new=14)
                active.append(slot)
            fed.append(int(logits.argmax()))
        a, b = native.step(slots[0], fed), python.step(slots[1], fed)
        assert relative(a, b) <= 1e-5
        fed = b.argmax(-1).tolist()


@pytest.mark.parametrize("option", ["qk_norm", "gemma2", "gemma3", "olmo2", "granite", "smollm3-phi4"])
def test_generate_takes_the_native_step_and_matches_the_python_one(option, monkeypatch):
    model = build(option, seed=4)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6], [0, 0, 0, 2, 7, 1, 8, 2]])
    mask = prompt != 0
    native: dict = {}
    _, fast = generate(model, prompt, 12, greedy=True, prompt_padding_mask=mask, return_logits=True, stats=native)
    monkeypatch.setenv("ONEBLOCK_NATIVE_STEP", "0")
    python: dict = {}
    _, slow = generate(model, prompt, 12, greedy=True, prompt_padding_mask=mask, return_logits=True, stats=python)
    assert (native["decode_step"], python["decode_step"]) == ("native", "python")
    assert native["decode_step_reason"] is None
    assert relative(fast, slow) <= 1e-5


@pytest.mark.parametrize("option", ["gemma3", "olmo2", "granite", "smollm3-phi4"])
def test_threads_and_instruction_sets_agree_with_every_option(option):
    scalar, python = decode_across_threads_and_isas(build(option, seed=5), [[5, 17, 3, 8, 9, 10], [7, 8]], steps=8)
    assert relative(scalar, python) <= 1e-5


def test_the_layout_carries_each_layers_options():
    """Gemma 3: the window and the local tables on the local layer only; the options' tensors in every layer."""
    plan = NativeStep.of(build("gemma3"))
    assert plan is not None
    fields = plan.fields
    assert (fields.sizes["out_norm"], fields.sizes["qk_norm"]) == (1, 1)  # sandwich, per head
    assert fields.layer_sizes == [{"window": 4, "rope": 2}, {"window": 0, "rope": 1}]  # layers 0 (local) and 1
    scalars = fields.scalars
    assert scalars["embed_scale"] == pytest.approx(SMALL["d_model"] ** 0.5)
    assert scalars["attn_softcap"] == scalars["logit_softcap"] == 0.0
    assert scalars["residual_multiplier"] == scalars["logits_scaling"] == 1.0
    assert len(fields.layers) == SMALL["n_layers"]
    options = {"q_norm_w", "k_norm_w", "attn_out_norm_w", "ffn_out_norm_w"}
    assert all(options <= layer.keys() for layer in fields.layers)


def test_the_layout_carries_olmo2_granite_and_smollm3_options():
    """OLMo 2: output norms alone (no input norms' tensors), q/k norms over the width; Granite's scalars; SmolLM3's
    layer without rotary; partial rotary's narrow tables."""
    olmo2 = NativeStep.of(build("olmo2"))
    assert olmo2 is not None
    assert (olmo2.fields.sizes["out_norm"], olmo2.fields.sizes["qk_norm"]) == (2, 2)
    layer = olmo2.fields.layers[0]
    assert "attn_norm_w" not in layer and "ffn_norm_w" not in layer
    d_head = SMALL["d_model"] // LLAMA["n_heads"]
    assert (layer["q_norm_w"].shape, layer["k_norm_w"].shape) == ((6 * d_head,), (2 * d_head,))
    granite = NativeStep.of(build("granite"))
    assert granite is not None
    scalars = granite.fields.scalars
    assert (scalars["embed_scale"], scalars["attn_scale"]) == (6.0, 0.3)
    assert (scalars["residual_multiplier"], scalars["logits_scaling"]) == pytest.approx((0.22, 8.0))
    smollm3 = NativeStep.of(build("smollm3-phi4"))
    assert smollm3 is not None
    assert smollm3.fields.layer_sizes == [{"window": 4, "rope": 1}, {"window": 0, "rope": 0}]  # layer 1: no rotary
    assert smollm3.fields.tensors["rope_cos"].shape[1] == 2  # (P, rope_dims)
