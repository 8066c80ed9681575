"""The GGUF default path: the memory-mapped reader, every block matrix run as stored, NaN weights refused.

Each Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 matrix becomes a ``BlockLinear`` (or, for the token table, a ``BlockEmbedding``)
holding the file's bytes: their dequantized values equal the exact model's weights bit for bit (query/key rows
un-interleaved, stacked projections in order), and the logits stay within the rounding of the activations to 8-bit
blocks (llama.cpp's algorithm) of the exact model's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from test_gguf import QUANT, hf_llama, ids, write_gguf  # noqa: E402

from oneblock.errors import ConversionError  # noqa: E402
from oneblock.io.gguf.dequant import dequantize  # noqa: E402
from oneblock.io.gguf.layout import read_layout  # noqa: E402
from oneblock.io.gguf.load import from_gguf  # noqa: E402
from oneblock.layers.quantized import BlockEmbedding, BlockLinear  # noqa: E402


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


@pytest.mark.parametrize(
    ("qtype", "tie"), [(Q.Q4_0, True), (Q.Q4_1, False), (Q.Q5_0, True), (Q.Q5_1, False), (Q.Q8_0, True)]
)
def test_default_model_holds_the_files_blocks_and_nothing_in_float(tmp_path, qtype, tie):
    path = write_gguf(tmp_path / "q.gguf", hf_llama(QUANT, tie=tie, seed=3), qtype)
    fast, exact = from_gguf(path), from_gguf(path, dtype=torch.float32)
    attn, ffn = fast.blocks[0].attn, fast.blocks[1].ffn
    assert isinstance(attn.qkv_proj, BlockLinear) and attn.q_proj is None  # q, k, v stacked
    assert isinstance(ffn.w13, BlockLinear) and ffn.w1 is None and ffn.w3 is None  # gate, up stacked
    assert isinstance(attn.o_proj, BlockLinear) and isinstance(ffn.w2, BlockLinear)
    assert isinstance(fast.embed.tok, BlockEmbedding) and isinstance(fast.lm_head, BlockLinear)
    if tie:  # one matrix: the lookup's rows and the head's product
        assert fast.lm_head.blocks.data_ptr() == fast.embed.tok.blocks.data_ptr()
    assert [n for n, p in fast.named_parameters() if p.dim() > 1] == []  # no float copy of any matrix
    # the blocks stand for exactly the weights of the dequantized reference, query/key rows included
    for i, block in enumerate(fast.blocks):
        ref = exact.blocks[i]
        stacked = torch.cat([ref.attn.q_proj.weight, ref.attn.k_proj.weight, ref.attn.v_proj.weight])
        assert torch.equal(block.attn.qkv_proj.dequantized(), stacked)
        assert torch.equal(block.ffn.w13.dequantized(), torch.cat([ref.ffn.w1.weight, ref.ffn.w3.weight]))
        assert torch.equal(block.ffn.w2.dequantized(), ref.ffn.w2.weight)
    assert torch.equal(fast.embed.tok.dequantized(), exact.embed.tok.weight)
    assert torch.equal(fast.lm_head.dequantized(), exact.lm_head.weight)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0])
def test_default_model_stays_within_the_activation_rounding_of_the_exact_one(tmp_path, qtype):
    path = write_gguf(tmp_path / "q.gguf", hf_llama(QUANT, tie=False, seed=3), qtype)
    fast, exact = from_gguf(path), from_gguf(path, dtype=torch.float32)
    x = ids(2, 9, 211, seed=4)
    with torch.no_grad():
        a, b = fast(x), exact(x)
    spread = (b.amax(-1) - b.amin(-1)).mean().item()
    # 8-bit activations in every product (llama.cpp's rounding): measured ~1.9% of the logit range here
    assert (a - b).abs().max().item() <= 0.04 * spread
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.8


def test_matrices_of_different_formats_are_not_stacked(tmp_path):
    hf = hf_llama(QUANT, tie=True, seed=9)
    up = hf.model.layers[0].mlp.up_proj.weight.detach().numpy()
    raw = {"blk.0.ffn_up.weight": (Q.Q8_0, gguf.quants.quantize(up, Q.Q8_0))}
    path = write_gguf(tmp_path / "mixed.gguf", hf, Q.Q4_1, raw=raw)
    fast, exact = from_gguf(path), from_gguf(path, dtype=torch.float32)
    ffn0, ffn1 = fast.blocks[0].ffn, fast.blocks[1].ffn
    assert ffn0.w13 is None and (ffn0.w1.file_format, ffn0.w3.file_format) == ("q4_1", "q8_0")
    assert isinstance(ffn1.w13, BlockLinear) and ffn1.w13.file_format == "q4_1"
    x = ids(1, 6, 211, seed=10)
    with torch.no_grad():
        a, b = fast(x), exact(x)
    assert (a - b).abs().max().item() <= 0.04 * (b.amax(-1) - b.amin(-1)).mean().item()


@pytest.mark.parametrize(
    ("down", "output", "head"), [(Q.Q6_K, Q.Q4_K, Q.Q6_K), (Q.Q5_K, Q.IQ4_XS, Q.IQ4_NL)], ids=["q4_k_m", "q5_k_iq4"]
)
def test_k_quant_matrices_stay_as_stored(tmp_path, monkeypatch, down, output, head):
    """Q4_K_M, Q5_K_M and IQ4_XS files hold K-quant and IQ4 matrices (rows of a multiple of 256 values; IQ4_NL's blocks
    are of 32): each becomes a BlockLinear of the file's bytes (interleaved 16 rows at a time where a layout
    exists), equal to gguf's dequantized values, and the model keeps to the exact one within the activations'
    rounding; it decodes with the native step (where the C++ library is built), as the Python step does."""
    from oneblock import kernels
    from oneblock.inference.generation import generate
    from oneblock.inference.native_step import ENV

    sizes = {**QUANT, "hidden_size": 256, "num_attention_heads": 8, "intermediate_size": 256}
    hf = hf_llama(sizes, tie=False, seed=12)
    raw = {}
    matrices = (("blk.0.ffn_down.weight", 256, down), ("blk.1.attn_output.weight", 256, output))
    for name, rows, qtype in (*matrices, ("output.weight", 211, head)):
        g = np.random.default_rng(len(raw))
        spec = kernels.FORMATS[qtype.name.lower()]
        blocks = g.integers(0, 256, (rows * 256 // spec.block, spec.nbytes), dtype=np.uint8)
        scales = (g.random((len(blocks), 2)) * 2e-3).astype(np.float16).view(np.uint8)  # two float16 a block
        blocks[:, spec.d_offset : spec.d_offset + 2] = scales[:, :2]  # d (last in a Q6_K block)
        if spec.has_min:
            blocks[:, 2:4] = scales[:, 2:]  # dmin, after d
        raw[name] = (qtype, blocks.reshape(rows, -1))
    path = write_gguf(tmp_path / "kq.gguf", hf, Q.Q8_0, raw=raw)
    fast, exact = from_gguf(path), from_gguf(path, dtype=torch.float32)
    layers = (fast.blocks[0].ffn.w2, fast.blocks[1].attn.o_proj, fast.lm_head)
    for layer, name in zip(layers, ("blk.0.ffn_down.weight", "blk.1.attn_output.weight", "output.weight"), strict=True):
        qtype = raw[name][0]
        fmt, interleavable = qtype.name.lower(), kernels.interleaved_format(qtype.name.lower()) is not None
        stored = f"{fmt}x16" if interleavable and layer.out_features % 16 == 0 and kernels.backend() != "torch" else fmt
        assert isinstance(layer, BlockLinear) and layer.fmt == stored  # the rows interleaved where a layout exists
        theirs = gguf.quants.dequantize(raw[name][1], qtype)
        assert torch.equal(layer.dequantized(), torch.from_numpy(theirs))
    assert torch.equal(fast.lm_head.dequantized(), exact.lm_head.weight)
    x = ids(2, 9, 211, seed=13)
    with torch.no_grad():
        a, b = fast(x), exact(x)
    assert (a - b).abs().max().item() <= 0.04 * (b.amax(-1) - b.amin(-1)).mean().item()
    native: dict = {}
    _, quick = generate(fast, x, 6, greedy=True, return_logits=True, stats=native)
    monkeypatch.setenv(ENV, "0")
    python: dict = {}
    _, slow = generate(fast, x, 6, greedy=True, return_logits=True, stats=python)
    assert native["decode_step"] == ("python" if kernels.backend() == "torch" else "native"), native
    assert ((quick - slow).abs().max() / slow.abs().max()).item() <= 1e-5


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
    for dtype in (None, torch.float32):  # the block path checks the scales, the dequantized one the values
        with pytest.raises(ConversionError, match=r"'blk.0.attn_output.weight' holds \d+ NaN or infinite"):
            from_gguf(path, dtype=dtype)


def test_fast_model_decodes_the_same_compiled_and_eager(tmp_path):
    from oneblock.inference.generation import generate

    model = from_gguf(write_gguf(tmp_path / "q4.gguf", hf_llama(QUANT, tie=True, seed=7), Q.Q4_0))
    prompt = ids(1, 5, 211, seed=8)
    eager = generate(model, prompt, 5, greedy=True, return_logits=True)
    compiled = generate(model, prompt, 5, greedy=True, return_logits=True, compile="aot_eager")
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


def test_q2_k_and_q3_k_matrices_load_exactly_in_float_and_say_so(tmp_path, capsys):
    """No block kernel multiplies Q2_K or Q3_K: their matrices are dequantized at load to gguf's values, and one line on
    stderr says which run in float; a file without them loads silently."""
    sizes = {**QUANT, "hidden_size": 256, "num_attention_heads": 8, "intermediate_size": 256}
    hf = hf_llama(sizes, tie=False, seed=14)
    raw = {}
    for name, qtype, nbytes, d_at in (
        ("blk.0.ffn_down.weight", Q.Q2_K, 84, 80),
        ("blk.1.attn_output.weight", Q.Q3_K, 110, 108),
    ):
        g = np.random.default_rng(len(raw))
        blocks = g.integers(0, 256, (256, nbytes), dtype=np.uint8)  # 256 rows of one super-block each
        scales = (g.random((256, 2)) * 2e-3).astype(np.float16).view(np.uint8)
        blocks[:, d_at:] = scales[:, : nbytes - d_at]  # d (and Q2_K's dmin), last in these blocks
        raw[name] = (qtype, blocks)
    path = write_gguf(tmp_path / "q2.gguf", hf, Q.Q8_0, raw=raw)
    capsys.readouterr()
    model = from_gguf(path, cache=False)
    err = capsys.readouterr().err
    assert err == (
        "oneblock: 2 matrices stored as Q2_K, Q3_K (such as blk.0.ffn_down.weight) run in float32, dequantized at "
        "load: oneblock has no block kernel for these types (more memory, slower)\n"
    )
    for layer, name in (
        (model.blocks[0].ffn.w2, "blk.0.ffn_down.weight"),
        (model.blocks[1].attn.o_proj, "blk.1.attn_output.weight"),
    ):
        assert type(layer) is torch.nn.Linear
        assert torch.equal(layer.weight, torch.from_numpy(gguf.quants.dequantize(raw[name][1], raw[name][0])))
    from_gguf(write_gguf(tmp_path / "q8.gguf", hf, Q.Q8_0), cache=False)
    assert capsys.readouterr().err == ""
