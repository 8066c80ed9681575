"""The GGUF fast path: the memory-mapped reader, 4-bit matrices run as stored, NaN weights refused.

``Int4Linear`` packs a file's Q4_0 / Q4_1 codes for torch's int4 kernel. Through the kernel's float32 path its
product equals ``x @ dequantized(W).T`` within float32 rounding, which proves the scales and offsets reproduce the
file's values; the fast bfloat16 path is held to bfloat16's precision (2% of the output's scale).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from test_gguf import QUANT, hf_llama, ids, write_gguf  # noqa: E402

from oneblock.errors import ConversionError  # noqa: E402
from oneblock.inference.int4 import Int4Linear  # noqa: E402
from oneblock.io.gguf.dequant import dequantize, int4_parts  # noqa: E402
from oneblock.io.gguf.layout import read_layout  # noqa: E402
from oneblock.io.gguf.load import from_gguf  # noqa: E402


def one_tensor_file(path, data, qtype):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "one tensor")
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0])
    writer.add_tensor("t", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_int4_layer_reproduces_the_dequantized_product(tmp_path, qtype):
    w = np.random.default_rng(0).standard_normal((80, 160)).astype(np.float32)  # N 80, K 160 (5 groups)
    path = one_tensor_file(tmp_path / "w.gguf", gguf.quants.quantize(w, qtype), qtype)
    (t,) = read_layout(path).tensors.values()
    dense = dequantize(t)  # (80, 160) float32, bit-identical to gguf's reference decoder (test_gguf)
    layer = Int4Linear(*int4_parts(t.name, t.ggml_type, t.shape, t.data))
    x = torch.randn(7, 160, generator=torch.Generator().manual_seed(1))
    exact = x.double() @ dense.double().T  # (7, 80)
    scale = (x.abs().double() @ dense.abs().double().T).max().item()
    assert (layer.forward_exact(x).double() - exact).abs().max().item() <= 1e-6 * scale  # float32 rounding
    assert (layer(x).double() - exact).abs().max().item() <= 2e-2 * scale  # bfloat16 activations and scales
    assert torch.allclose(layer.dequantized(), dense, rtol=0, atol=1e-6 * dense.abs().max().item())


def test_fast_model_keeps_4_bit_weights_and_stays_close_to_the_exact_one(tmp_path):
    path = write_gguf(tmp_path / "q4.gguf", hf_llama(QUANT, tie=False, seed=3), Q.Q4_1)
    fast, exact = from_gguf(path), from_gguf(path, dtype=torch.float32)
    attn = fast.blocks[0].attn
    assert isinstance(attn.qkv_proj, Int4Linear) and attn.q_proj is None  # q, k, v fused
    assert isinstance(fast.blocks[1].ffn.w2, Int4Linear) and isinstance(attn.o_proj, Int4Linear)
    # no float copy of a 4-bit matrix: the blocks hold int4 codes, float32 only in the norms
    floats = [n for n, p in fast.blocks.named_parameters() if p.dim() > 1]
    assert floats == []
    x = ids(2, 9, 211, seed=4)
    with torch.no_grad():
        a, b = fast(x), exact(x)
    spread = (b.amax(-1) - b.amin(-1)).mean().item()
    assert (a - b).abs().max().item() <= 0.03 * spread  # bfloat16 activations in the 4-bit products
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.8


def test_layout_reads_what_gguf_reader_reads(tmp_path):
    path = write_gguf(tmp_path / "q8.gguf", hf_llama(QUANT, tie=True, seed=5), Q.Q8_0)
    layout, reader = read_layout(path), gguf.GGUFReader(path)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            ours = layout.metadata[key]  # numeric arrays are numpy views of the file
            assert (ours.tolist() if isinstance(ours, np.ndarray) else ours) == field.contents(), key
    for t in reader.tensors:
        ours = layout.tensors[t.name]
        assert ours.offset == t.data_offset and ours.ggml_type == t.tensor_type
        assert torch.equal(ours.data, torch.from_numpy(np.array(t.data).reshape(-1).view(np.uint8)))


def test_nan_and_infinite_weights_are_refused_by_name(tmp_path):
    w = np.ones((4, 32), dtype=np.float32)
    w[2, 5] = np.nan
    path = one_tensor_file(tmp_path / "nan.gguf", w, None)
    with pytest.raises(ConversionError, match=r"tensor 't' holds 1 NaN or infinite value\(s\) of 128"):
        dequantize(next(iter(read_layout(path).tensors.values())))
    hf = hf_llama(QUANT, tie=True, seed=6)
    bad = gguf.quants.quantize(np.ones((96, 96), dtype=np.float32), Q.Q4_1).copy()
    bad[3, 0:2] = np.frombuffer(np.float16(np.inf).tobytes(), dtype=np.uint8)  # the first block's scale d
    path = write_gguf(tmp_path / "inf.gguf", hf, raw={"blk.0.attn_output.weight": (Q.Q4_1, bad)})
    for dtype in (None, torch.float32):  # the 4-bit path checks the scales, the dequantized one the values
        with pytest.raises(ConversionError, match=r"'blk.0.attn_output.weight' holds \d+ NaN or infinite"):
            from_gguf(path, dtype=dtype)


def test_fast_model_decodes_the_same_compiled_and_eager(tmp_path):
    from oneblock.inference.generation import generate

    model = from_gguf(write_gguf(tmp_path / "q4.gguf", hf_llama(QUANT, tie=True, seed=7), Q.Q4_0))
    prompt = ids(1, 5, 211, seed=8)
    eager = generate(model, prompt, 5, greedy=True, return_logits=True)
    compiled = generate(model, prompt, 5, greedy=True, return_logits=True, compile="aot_eager")
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])
