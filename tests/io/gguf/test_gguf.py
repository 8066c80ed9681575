"""Llama-family GGUF files: dequantization, the q/k row order, the config, and logits equal to transformers'.

Small files are written here with ``gguf.GGUFWriter`` from random ``LlamaForCausalLM`` models, in the layout
llama.cpp's converter produces (query/key rows interleaved, 1-D norms in F32). transformers loads the same file
(``gguf_file=``) and is the reference; the F32 file is also checked against the original model. The real
SmolLM2-135M-Instruct file is checked in test_gguf_smollm2.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from oneblock import CheckpointError, ConversionError  # noqa: E402
from oneblock.io.gguf.dequant import dequantize  # noqa: E402
from oneblock.io.gguf.file import open_gguf  # noqa: E402
from oneblock.io.gguf.load import from_gguf, oneblock_name, read_gguf, unpermute_rows  # noqa: E402

# Quantized rows must hold whole 32-value blocks, so the quantized model's widths are multiples of 32;
# everything else is distinct: V 211, C 96, H 6 (Dh 16), Hkv 2, F 160, 2 layers, 64 positions.
QUANT = dict(vocab_size=211, hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=160)
# The F32 model has odd sizes throughout: V 203, C 48, H 6 (Dh 8), Hkv 2, F 37.
ODD = dict(vocab_size=203, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=37)

_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_HF_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def hf_llama(sizes: dict, *, tie: bool, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0,
        tie_word_embeddings=tie, attn_implementation="eager", bos_token_id=1, eos_token_id=2, pad_token_id=0,
        **sizes,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from one, weights larger than the 0.02 init, so errors show
        for p in model.parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if p.dim() == 1 else 0.1 * torch.randn_like(p))
    return model


def gguf_name(hf_name: str) -> str:
    if hf_name in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module = rest.rsplit(".", 1)[0]
    return f"blk.{layer}.{_HF_BLOCK[module]}.weight"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave the two rotary halves of each head's rows."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, model, qtype: Q = Q.F32, *, arch: str = "llama", kv: dict | None = None, raw: dict | None = None):
    """Write ``model`` as llama.cpp would: matrices in ``qtype``, norms in F32, q/k rows permuted.

    ``kv`` replaces or adds metadata (``{key: (value, GGUFValueType)}``; a value of None drops the key);
    ``raw`` replaces tensors by ``{gguf_name: (ggml_type, bytes array)}``.
    """
    cfg = model.config
    u32, f32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    metadata = {
        "context_length": (cfg.max_position_embeddings, u32),
        "embedding_length": (cfg.hidden_size, u32),
        "block_count": (cfg.num_hidden_layers, u32),
        "feed_forward_length": (cfg.intermediate_size, u32),
        "attention.head_count": (cfg.num_attention_heads, u32),
        "attention.head_count_kv": (cfg.num_key_value_heads, u32),
        "attention.layer_norm_rms_epsilon": (cfg.rms_norm_eps, f32),
        "rope.freq_base": (cfg.rope_parameters["rope_theta"], f32),
        "rope.dimension_count": (cfg.hidden_size // cfg.num_attention_heads, u32),
        "vocab_size": (cfg.vocab_size, u32),
    }
    metadata = {f"{arch}.{key}": value for key, value in metadata.items()}
    metadata.update({"tokenizer.ggml.bos_token_id": (1, u32), "tokenizer.ggml.eos_token_id": (2, u32)})
    metadata.update(kv or {})
    writer = gguf.GGUFWriter(str(path), arch)
    for key, (value, vtype) in metadata.items():
        if value is not None:
            writer.add_key_value(key, value, vtype)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        target = gguf_name(name)
        w = tensor.numpy()
        if ".attn_q." in target:
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif ".attn_k." in target:
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        if raw and target in raw:
            writer.add_tensor(target, raw[target][1], raw_dtype=raw[target][0])
        elif w.ndim == 1 or qtype == Q.F32:
            writer.add_tensor(target, w.astype(np.float32))
        elif qtype == Q.F16:
            writer.add_tensor(target, w.astype(np.float16))
        else:
            writer.add_tensor(target, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference(path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def ids(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- small files


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.randn(6 * 16, 37)
    permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), 6))
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rows(permuted, 6), w)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_dequantize_equals_gguf_reference(tmp_path, qtype):
    x = np.random.default_rng(0).standard_normal((7, 96)).astype(np.float32) * 3
    data = x.astype(np.float16) if qtype == Q.F16 else gguf.quants.quantize(x, qtype)
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tensor("t", data, raw_dtype=None if qtype == Q.F16 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = open_gguf(tmp_path / "t.gguf").tensors
    ours = dequantize(tensor)
    theirs = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    assert ours.shape == (7, 96) and ours.dtype == torch.float32
    assert torch.equal(ours, torch.from_numpy(np.asarray(theirs, dtype=np.float32)))
    # and the decoded values are the input up to the format's resolution (half a step, relative to max |x|)
    step = {
        Q.F16: 2**-10,
        Q.BF16: 2**-7,
        Q.Q8_0: 1 / 127,
        Q.Q5_0: 1 / 16,
        Q.Q5_1: 2 / 31,
        Q.Q4_0: 1 / 4,
        Q.Q4_1: 2 / 15,
    }
    assert np.abs(ours.numpy() - x).max() <= step[qtype] / 2 * np.abs(x).max() * 1.01
    assert dequantize(tensor, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_q4_0_block_layout_by_hand(tmp_path):
    # One block: scale 0.5, codes 0..15 in the low nibbles (values 0..15) and 15..0 in the high (values 16..31).
    codes = np.arange(16, dtype=np.uint8)
    block = np.concatenate([np.array([0.5], np.float16).view(np.uint8), codes | ((15 - codes) << 4)])
    writer = gguf.GGUFWriter(str(tmp_path / "b.gguf"), "llama")
    writer.add_tensor("b", block.reshape(1, 18), raw_dtype=Q.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = open_gguf(tmp_path / "b.gguf").tensors
    expected = 0.5 * (np.concatenate([codes, 15 - codes]).astype(np.float32) - 8)
    assert torch.equal(dequantize(tensor), torch.from_numpy(expected).reshape(1, 32))


def test_f32_file_matches_original_model(tmp_path):
    for tie in (False, True):
        hf = hf_llama(ODD, tie=tie, seed=1)
        model = from_gguf(write_gguf(tmp_path / f"odd{tie}.gguf", hf))
        cfg = model.config
        assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_ff, cfg.vocab_size) == (
            48,
            6,
            2,
            8,
            37,
            203,
        )
        assert (cfg.norm, cfg.ffn, cfg.position, cfg.bias, cfg.tie_embeddings) == (
            "rmsnorm",
            "swiglu",
            "rope",
            False,
            tie,
        )
        assert (cfg.rope_theta, cfg.max_seq_len, cfg.bos_token_id, cfg.eos_token_id) == (5000.0, 64, 1, 2)
        assert cfg.norm_eps == pytest.approx(1e-5)
        if tie:
            assert model.lm_head.weight is model.embed.tok.weight
        assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
        x = ids(3, 7, 203, seed=2)
        with torch.no_grad():
            assert max_diff(model(x), hf(x).logits) <= 1e-5


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantized_file_matches_transformers(tmp_path, qtype):
    tie = qtype in (Q.F16, Q.Q4_0)
    path = write_gguf(tmp_path / f"{qtype.name}.gguf", hf_llama(QUANT, tie=tie, seed=3), qtype)
    ref = reference(path)
    _, state = read_gguf(path)
    theirs = ref.state_dict()
    for name, tensor in theirs.items():
        if name == "lm_head.weight" and tie:
            continue
        assert torch.equal(state[oneblock_name(gguf_name(name))], tensor), name  # bit-identical after un-permute
    model = from_gguf(path, dtype=torch.float32)  # the exact path: every tensor dequantized
    x = ids(2, 9, 211, seed=4)
    with torch.no_grad():
        assert max_diff(model(x), ref(x).logits) <= 1e-4


def test_bfloat16_load(tmp_path):
    path = write_gguf(tmp_path / "q8.gguf", hf_llama(QUANT, tie=False, seed=5), Q.Q8_0)
    full, half = from_gguf(path, dtype=torch.float32), from_gguf(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    x = ids(2, 9, 211, seed=6)
    with torch.no_grad():
        a, b = full(x), half(x).float()
    assert max_diff(a, b) <= 0.05 * a.abs().max().item()


# ---------------------------------------------------------------------------------------------- bad inputs


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="GGUF file not found"):
        from_gguf(tmp_path / "nope.gguf")


def test_directory(tmp_path):
    with pytest.raises(CheckpointError, match="expected a GGUF file"):
        from_gguf(tmp_path)


def test_empty_and_garbage_files(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError, match="0 bytes long, too short"):
        from_gguf(tmp_path / "empty.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"PK\x03\x04" + bytes(range(256)) * 4)
    with pytest.raises(CheckpointError, match=r"not a GGUF file: it starts with b'PK\\x03\\x04'"):
        from_gguf(tmp_path / "junk.gguf")


def test_truncated_file(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", hf_llama(ODD, tie=True, seed=7))
    data = path.read_bytes()
    for keep in (40, len(data) // 2):
        (tmp_path / "cut.gguf").write_bytes(data[:keep])
        with pytest.raises(CheckpointError, match="corrupt or truncated GGUF file"):
            from_gguf(tmp_path / "cut.gguf")


def test_non_llama_architecture(tmp_path):
    path = write_gguf(tmp_path / "g.gguf", hf_llama(ODD, tie=True, seed=8), arch="gpt2")
    with pytest.raises(ConversionError, match=r"architecture 'gpt2' is not supported; oneblock runs llama \(Llama"):
        from_gguf(path)


def test_unsupported_quant_type(tmp_path):
    hf = hf_llama(QUANT, tie=True, seed=9)
    mxfp4 = np.zeros((96, 96 // 32 * 17), dtype=np.uint8)  # MXFP4: 32 values in 17 bytes
    path = write_gguf(tmp_path / "mx.gguf", hf, raw={"blk.1.attn_v.weight": (Q.MXFP4, mxfp4)})
    with pytest.raises(ConversionError, match=r"'blk.1.attn_v.weight' is stored as MXFP4.*supported types: F32"):
        from_gguf(path)


U32 = gguf.GGUFValueType.UINT32


@pytest.mark.parametrize(
    ("kv", "match"),
    [
        ({"llama.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING)}, "RoPE scaling.*'yarn'"),
        ({"llama.expert_count": (8, U32)}, r"mixture-of-experts models \(llama.expert_count=8\)"),
        ({"llama.rope.dimension_count": (10, U32)}, r"rope_dims \(10\) must be even and at most d_head \(8\)"),
        ({"llama.vocab_size": (999, U32)}, r"vocab_size \(999\) disagrees with token_embd.weight \(203 rows\)"),
        ({"llama.attention.head_count": (None, U32)}, "lacks 'llama.attention.head_count'"),
        ({"tokenizer.ggml.padding_token_id": (5000, U32)}, r"impossible model: pad_token_id \(5000\) must lie in"),
        ({"llama.block_count": (3, U32)}, r"cannot fill a 3-block model from the GGUF tensors: missing \['blocks.2"),
    ],
)
def test_unsupported_or_inconsistent_metadata(tmp_path, kv, match):
    path = write_gguf(tmp_path / "v.gguf", hf_llama(ODD, tie=True, seed=10), kv=kv)
    with pytest.raises(ConversionError, match=match):
        from_gguf(path)


# ---------------------------------------------------------------------------------------------- SmolLM2
