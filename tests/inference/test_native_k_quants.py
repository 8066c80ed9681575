"""The native decode step multiplies the K-quants (Q4_K, Q6_K: super-blocks of 256 values, read with llama.cpp's
Q8_K activation blocks) as a Q4_K_M GGUF file mixes them: Q4_K for most matrices, Q6_K for v, down and the tied
token table, Q4_K in the file's layout and interleaved (q4_kx16), and 32-value formats (Q8_0 interleaved, Q5_0)
beside a K-quant in one product (gate and up); and as
Q5_K_M and IQ4 files mix Q5_K, IQ4_XS (256 values, Q8_K activations) and IQ4_NL (32 values, Q8_0 activations).

The native step rounds each input row to the blocks of every kind its product reads, with the same quantizers and
kernels as ``BlockLinear``: its logits are within 1e-5 of their scale of the Python step's, for one row and a
batch, over several tokens, read as a prompt in one call, with LoRA adapters served per row over the K-quant base,
on one and two threads and on the scalar instruction set. Both widths of a kv head's group of query heads are
covered: 256 (the attention output rounded to Q8_K per group) and 128 (in a pass of its own).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from native_testing import decode_across_threads_and_isas, decode_both, relative

import oneblock as ob
from oneblock import kernels
from oneblock.adapters.apply import apply_lora, lora_modules
from oneblock.adapters.lora import LoraConfig
from oneblock.adapters.multi import load_adapters
from oneblock.adapters.peft import save_adapter
from oneblock.inference.native_step import NativeStep
from oneblock.kernels.formats import FORMATS
from oneblock.layers.quantized import BlockEmbedding, BlockLinear

pytestmark = pytest.mark.skipif(kernels.backend() == "torch", reason="the native step needs the C++ library")

SIZES = {"vocab_size": 300, "d_model": 256, "n_heads": 4, "d_ff": 512, "max_seq_len": 32, "n_layers": 2}
LLAMA = {"norm": "rmsnorm", "ffn": "swiglu", "position": "rope", "bias": False, "tie_embeddings": True}
# weights of about 0.05 from random codes and sub-scales
D_SCALE = {"q4_k": 3e-4, "q6_k": 5e-5, "q5_k": 1.5e-4, "iq4_xs": 4e-5, "iq4_nl": 7e-4}
MEAN_CODE = {"q4_k": 7.5, "q5_k": 15.5}  # dmin / d: the minimums about the mean of d * scale * code
Q4_K, Q6_K = FORMATS["q4_k"].ggml_type, FORMATS["q6_k"].ggml_type
Q5_K, IQ4_XS, IQ4_NL = (FORMATS[name].ggml_type for name in ("q5_k", "iq4_xs", "iq4_nl"))
# a Q4_K_M file's formats, and those of Q5_K_M and IQ4 files: most matrices, v and down, the token table
MIXES = {"q4_k_m": ("q4_k", "q6_k", "q6_k"), "q5_k_iq4": ("q5_k", "iq4_xs", "iq4_nl")}


def k_blocks(fmt: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """(N, K / block * nbytes) uint8 random blocks, d of either sign (q4_k, q5_k: positive, with their dmin)."""
    spec = FORMATS[fmt]
    count = n * k // spec.block
    blocks = torch.randint(0, 256, (count, spec.nbytes), dtype=torch.uint8, generator=gen)
    d = (0.5 + torch.rand(count, 1, generator=gen)) * D_SCALE[fmt]
    if not spec.has_min:
        d = d * torch.where(torch.rand(count, 1, generator=gen) < 0.5, -1.0, 1.0)
    blocks[:, spec.d_offset : spec.d_offset + 2] = d.half().view(torch.uint8)
    if spec.has_min:  # so that the weights centre near 0
        blocks[:, 2:4] = (d * MEAN_CODE[fmt]).half().view(torch.uint8)
    return blocks.reshape(n, -1)


def k_quant_model(n_kv_heads: int, seed: int = 0, mix: str = "q4_k_m", vocab: int | None = None) -> torch.nn.Module:
    """A Llama-shaped decoder made of K-quant matrices (and one 32-value matrix in each gate/up product): ``mix``
    names the formats of most matrices, of v and down, and of the tied token table (:data:`MIXES`)."""
    main, side, table_format = MIXES[mix]
    torch.manual_seed(seed)
    sizes = {**SIZES, "vocab_size": vocab or SIZES["vocab_size"]}
    model = ob.build_model(ob.ModelConfig(**sizes, **LLAMA, n_kv_heads=n_kv_heads))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    gen = torch.Generator().manual_seed(seed)

    def blocks(module: torch.nn.Module, fmt: str) -> BlockLinear:
        return BlockLinear(k_blocks(fmt, module.out_features, module.in_features, gen), fmt)

    for i in range(SIZES["n_layers"]):
        attn, ffn = model.block(i).attn, model.block(i).ffn
        attn.q_proj, attn.k_proj, attn.o_proj = (blocks(m, main) for m in (attn.q_proj, attn.k_proj, attn.o_proj))
        attn.v_proj = blocks(attn.v_proj, side)
        if i == 0:  # q4_kx16 (q5_kx16) and q6_kx16 (iq4_xsx16) in layer 0, the file's layout in layer 1
            assert attn.q_proj.interleave() and attn.v_proj.interleave()
        ffn.w1, ffn.w2 = blocks(ffn.w1, main), blocks(ffn.w2, side)
        if i == 1 and mix == "q5_k_iq4":
            ffn.w3 = blocks(ffn.w3, "iq4_nl")  # blocks of 32 beside q5_k's 256
            continue
        first = "q8_0" if mix == "q4_k_m" else "q5_0"
        up = BlockLinear.from_float(0.2 * ffn.w3.weight, first if i == 0 else "q5_0")
        if i == 0:  # q8_0x16 (q5_0x16) beside the K-quant in layer 0, q5_0 in the file's layout in layer 1
            assert up.interleave()
        ffn.w3 = up
    table = k_blocks(table_format, sizes["vocab_size"], SIZES["d_model"], gen)
    model.embed.tok, model.lm_head = BlockEmbedding(table, table_format), BlockLinear(table, table_format)  # tied
    return model.eval()


@pytest.fixture(scope="module", params=[1, 2], ids=["group-of-256", "group-of-128"])
def model(request) -> torch.nn.Module:
    return k_quant_model(request.param)


def test_a_k_quant_model_takes_the_native_step(model):
    plan = NativeStep.plan(model)
    assert isinstance(plan, NativeStep), plan
    formats = plan.fields.formats
    assert formats["tok"] == formats["head_w"] == Q6_K  # the tied token table and head
    used = {f for layer in plan.fields.layer_formats or [] for f in layer.values()}
    interleaved = {kernels.INTERLEAVED[name].ggml_type for name in ("q8_0x16", "q4_kx16", "q6_kx16")}
    assert {Q4_K, Q6_K, FORMATS["q5_0"].ggml_type, *interleaved} <= used


@pytest.mark.parametrize("prompts", [[[5, 17, 3, 299, 42]], [[5, 17, 3, 299, 42], [7, 8], [60, 61, 62]]])
def test_native_logits_equal_the_python_step(model, prompts):
    native, python = decode_both(model, prompts, steps=8)
    assert python.abs().max() > 1.0  # logits far from uniform
    assert relative(native, python) <= 1e-5
    assert torch.equal(native.argmax(-1), python.argmax(-1))


def prompt_read_agrees(model: torch.nn.Module) -> None:
    """An 11-token prompt read in one native call (past 8 rows: the groups unpacked, the activations given
    unsigned by the step itself) against the Python forward: logits and cache within 1e-5."""
    ids = [5, 17, 3, 299, 42, 7, 8, 60, 61, 62, 11]
    plan = NativeStep.of(model)
    assert plan is not None
    ours, theirs = (model.new_cache(1, max_len=20, chunk=20) for _ in range(2))
    with torch.inference_mode():
        want = model.logits(model.run(torch.tensor([ids]), cache=theirs)[:, -1])[0]
        got = plan.prompt(torch.tensor(ids), 0, ours)
    assert got.shape == want.shape and relative(got, want) <= 1e-5
    for a, b in zip(ours.layers, theirs.layers, strict=True):
        assert relative(a.k[:, :, : len(ids)], b.k[:, :, : len(ids)]) <= 1e-5


def test_the_prompt_read_in_one_call_equals_the_python_forward(model):
    prompt_read_agrees(model)


def test_threads_and_instruction_sets_agree(model):
    scalar, python = decode_across_threads_and_isas(model, [[5, 17, 3], [7, 8, 9, 10]])
    assert relative(scalar, python) <= 1e-5


def test_lora_adapters_over_a_k_quant_base(tmp_path):
    """Two adapters over every kind of matrix (q4_k q and o, q6_k v and down, the q8_0x16 / q5_0 up), per row.

    The LoRA A matrices are seeded: both steps round the same activations to 8 bits, and the adapters' sums, added
    in another order, can put one value a float32 ulp to either side of a rounding boundary (then one code differs
    and a logit moves by about 1e-2); with the global generator's state left to the tests before, it did so.
    """
    torch.manual_seed(1)
    directories = []
    for seed, targets in enumerate([("q", "v", "up"), ("k", "o", "gate", "down")], start=1):
        cfg = LoraConfig(rank=4, alpha=8.0, targets=targets)
        float_model = apply_lora(ob.build_model(ob.ModelConfig(**SIZES, **LLAMA, n_kv_heads=2)), cfg)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for module in lora_modules(float_model).values():
                module.lora_B.weight.copy_(0.3 * torch.randn(module.lora_B.weight.shape, generator=gen))
        directories.append(save_adapter(float_model, tmp_path / f"adapter-{seed}", cfg=cfg))
    model = k_quant_model(2, seed=1)
    base = decode_both(model, [[5, 17, 3], [42, 8]], steps=6)[1]
    served = load_adapters(model, list(zip(["terse", "chatty"], directories, strict=True)))
    plan = NativeStep.of(model)
    assert plan is not None and plan.adapted
    served.rows.select([1, 2])
    native, python = decode_both(model, [[5, 17, 3], [42, 8]], steps=6)
    assert relative(native, python) <= 1e-5
    assert (python[0] - base[0]).abs().max() > 0.1  # the adapters change what their rows compute


def test_a_k_quant_matrix_of_the_wrong_width_is_refused(model):
    plan = NativeStep.of(model)
    assert plan is not None
    fields = dataclasses.replace(plan.fields, layers=[dict(layer) for layer in plan.fields.layers])
    assert fields.layer_formats is not None and fields.layer_formats[0]["down_w"] == Q6_K  # K = 512
    down = fields.layers[0]["down_w"]
    fields.layers[0]["down_w"] = down[:, : -FORMATS["q6_k"].nbytes].contiguous()  # a super-block short
    with pytest.raises(RuntimeError, match=r"layer 0's down_w must be uint8 \(N, 420\) blocks \(2 of 210 bytes\)"):
        fields.build()


@pytest.fixture(scope="module")
def q5_k_model() -> torch.nn.Module:
    return k_quant_model(2, seed=3, mix="q5_k_iq4")


def test_q5_k_and_iq4_matrices_decode_natively_equal_to_the_python_step(q5_k_model):
    """Q5_K (q, k, o, gate), IQ4_XS (v, down), IQ4_NL (the tied token table and head, layer 1's up beside Q5_K)."""
    plan = NativeStep.plan(q5_k_model)
    assert isinstance(plan, NativeStep), plan
    fields = plan.fields
    assert fields.formats["tok"] == fields.formats["head_w"] == IQ4_NL  # the tied token table and head
    used = {f for formats in [fields.formats, *(fields.layer_formats or [])] for f in formats.values()}
    interleaved = {kernels.INTERLEAVED[name].ggml_type for name in ("q5_0x16", "q5_kx16", "iq4_xsx16")}
    assert {Q5_K, IQ4_XS, IQ4_NL, *interleaved} <= used
    for prompts in ([[5, 17, 3, 299, 42]], [[5, 17, 3, 299, 42], [7, 8], [60, 61, 62]]):
        native, python = decode_both(q5_k_model, prompts, steps=6)
        assert python.abs().max() > 1.0  # logits far from uniform
        assert relative(native, python) <= 1e-5
        assert torch.equal(native.argmax(-1), python.argmax(-1))


def test_q5_k_and_iq4_prompt_read_in_one_call_equals_the_python_forward(q5_k_model):
    prompt_read_agrees(q5_k_model)


def test_q5_k_and_iq4_threads_and_instruction_sets_agree(q5_k_model):
    scalar, python = decode_across_threads_and_isas(q5_k_model, [[5, 17, 3], [7, 8, 9, 10]])
    assert relative(scalar, python) <= 1e-5


def test_an_interleaved_token_table_and_head_decode_as_the_files():
    """The tied Q6_K table in the interleaved layout (q6_kx16, as the GGUF loader leaves it): the native step reads
    its embedding rows and multiplies its head exactly as in the file's layout, token by token and as a prompt."""
    model = k_quant_model(1, vocab=304)
    ids = torch.tensor([5, 17, 3, 299, 42, 7, 8, 60, 61, 62, 11])
    runs = []
    for layout in ("q6_k", "q6_kx16"):
        table = model.lm_head.blocks if layout == "q6_k" else kernels.interleave(model.lm_head.blocks, "q6_k")
        model.embed.tok, model.lm_head = BlockEmbedding(table, layout), BlockLinear(table, layout)
        plan = NativeStep.of(model)
        assert plan is not None and plan.fields.formats["tok"] == kernels.get_format(layout).ggml_type
        with torch.inference_mode():
            prompt = plan.prompt(ids, 0, model.new_cache(1, max_len=20, chunk=20))
        runs.append((prompt, decode_both(model, [ids.tolist()], steps=4)[0]))
    (prompt_file, steps_file), (prompt_x16, steps_x16) = runs
    assert torch.equal(prompt_file, prompt_x16) and torch.equal(steps_file, steps_x16)
