"""Writing GGUF files: models read back exactly (F32) or to the format's rounding (F16, Q8_0), LoRA adapters laid
out as llama.cpp's convert_lora_to_gguf.py writes them, the tokenizer copied with its types, the digest checked,
bad input refused. llama.cpp itself reading these files is tests/io/gguf/test_gguf_llamacpp.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from oneblock.adapters.apply import apply_lora, lora_modules
from oneblock.adapters.gguf import lora_delta, save_gguf_adapter
from oneblock.adapters.lora import LoraConfig
from oneblock.config import ModelConfig
from oneblock.errors import CheckpointError, ConversionError
from oneblock.io.gguf.layout import read_layout
from oneblock.io.gguf.load import from_gguf, unpermute_rows
from oneblock.io.gguf.write import gguf_name, permute_rows, save_gguf
from oneblock.io.gguf.writer import Entry, typed_metadata
from oneblock.models.build import build_decoder

Q = gguf.GGMLQuantizationType


def tiny_llama(*, tie: bool, d_model: int = 64, n_heads: int = 4, n_kv: int = 2, seed: int = 0) -> torch.nn.Module:
    """A random Llama-family decoder; d_ff 96 = 3 Q8_0 blocks, d_ff 37 (with d_model 36) none. GGUF stores the
    epsilon as float32, so it is one that float32 holds exactly."""
    cfg = ModelConfig(
        arch="decoder", vocab_size=101, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv, n_layers=2,
        d_ff=96 if d_model % 32 == 0 else 37, max_seq_len=64, norm="rmsnorm", ffn="swiglu", position="rope",
        bias=False, tie_embeddings=tie, norm_eps=2.0**-17, rope_theta=10000.0, activation="silu",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = build_decoder(cfg).eval()
    with torch.no_grad():  # norms away from 1, so that a norm written as a matrix or dropped shows
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape))
    return model


def test_permute_rows_inverts_unpermute_rows():
    w = torch.randn(6 * 16, 37)
    assert not torch.equal(permute_rows(w, 6), w)
    assert torch.equal(unpermute_rows(permute_rows(w, 6), 6), w)
    assert torch.equal(permute_rows(unpermute_rows(w, 6), 6), w)


def test_names_are_llama_cpps():
    assert gguf_name("blocks.3.ffn.w1.weight") == "blk.3.ffn_gate.weight"
    assert gguf_name("blocks.0.attn.q_proj.weight") == "blk.0.attn_q.weight"
    assert gguf_name("embed.tok.weight") == "token_embd.weight"
    with pytest.raises(ConversionError, match=r"'blocks.0.attn.q_proj.lora_A.weight' has no place.*merge LoRA"):
        gguf_name("blocks.0.attn.q_proj.lora_A.weight")


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("width", [(64, 4, 2), (36, 3, 1)])
def test_f32_reads_back_bit_equal(tmp_path, tie, width):
    d_model, n_heads, n_kv = width
    model = tiny_llama(tie=tie, d_model=d_model, n_heads=n_heads, n_kv=n_kv)
    path = save_gguf(model, tmp_path / "m.gguf")
    layout = read_layout(path)
    assert layout.metadata["general.architecture"] == "llama" and layout.metadata["general.file_type"] == 0
    assert ("output.weight" in layout.tensors) is not tie
    assert {t.ggml_type for t in layout.tensors.values()} == {int(Q.F32)}
    back = from_gguf(path, dtype=torch.float32)
    assert back.config.replace(extra={}) == model.config.replace(extra={})
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    x = torch.randint(0, 101, (3, 7), generator=torch.Generator().manual_seed(1))
    assert torch.equal(model(x), back(x))


def test_query_and_key_rows_are_stored_in_llama_cpp_order(tmp_path):
    model = tiny_llama(tie=True)
    layout = read_layout(save_gguf(model, tmp_path / "m.gguf"))
    stored = torch.from_numpy(gguf.quants.dequantize(layout.tensors["blk.1.attn_k.weight"].data.numpy(), Q.F32))
    expected = permute_rows(model.blocks[1].attn.k_proj.weight.detach(), 2)
    assert torch.equal(stored.reshape(expected.shape), expected)


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_f16_and_q8_0_equal_the_formats_rounding(tmp_path, kind):
    model = tiny_llama(tie=False, d_model=36, n_heads=3, n_kv=1)  # d_ff 37: w2's rows hold no whole Q8_0 block
    path = save_gguf(model, tmp_path / "m.gguf", tensor_type=kind)
    layout = read_layout(path)
    qtype = Q.F16 if kind == "f16" else Q.Q8_0
    back = from_gguf(path, dtype=torch.float32).state_dict()
    for name, weight in model.state_dict().items():
        stored = layout.tensors[gguf_name(name)].ggml_type
        if weight.ndim == 1:
            assert stored == Q.F32 and torch.equal(back[name], weight), name
            continue
        expected_type = Q.F16 if weight.shape[1] % 32 else qtype
        assert stored == expected_type, name
        w = weight.detach().numpy()
        rounded = w.astype(np.float16) if expected_type == Q.F16 else gguf.quants.quantize(w, Q.Q8_0)
        expected = torch.from_numpy(np.asarray(gguf.quants.dequantize(rounded, expected_type), dtype=np.float32))
        assert torch.equal(back[name], expected.reshape(weight.shape)), name
    assert layout.metadata["general.file_type"] == (1 if kind == "f16" else 7)


def test_bf16_matrices_are_the_weights_rounded_to_bfloat16_and_load_as_stored(tmp_path):
    model = tiny_llama(tie=True, d_model=36, n_heads=3, n_kv=1)
    path = save_gguf(model, tmp_path / "m.gguf", tensor_type="bf16")
    layout = read_layout(path)
    back = from_gguf(path, dtype=torch.float32).state_dict()
    for name, weight in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: not written
        record = layout.tensors[gguf_name(name)]
        assert record.ggml_type == (Q.F32 if weight.ndim == 1 else Q.BF16), name
        expected = weight if weight.ndim == 1 else weight.bfloat16().float()
        assert torch.equal(back[name], expected), name
        stored = gguf.quants.dequantize(record.data.numpy(), record.ggml_type)  # the gguf package reads the same
        heads = {"q_proj": 3, "k_proj": 1}.get(name.split(".")[-2])  # llama.cpp's row order for q and k
        in_file = expected if heads is None else permute_rows(expected, heads)
        assert np.array_equal(np.asarray(stored, dtype=np.float32).reshape(expected.shape), in_file.numpy()), name
    assert layout.metadata["general.file_type"] == 32  # llama.cpp's LLAMA_FTYPE_MOSTLY_BF16
    kept = from_gguf(path)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(kept(ids), from_gguf(path, dtype=torch.float32)(ids), rtol=0, atol=1e-5)


def test_tokenizer_entries_are_copied_with_their_types(tmp_path):
    vocab = [
        Entry("tokenizer.ggml.model", "gpt2", 8),
        Entry("tokenizer.ggml.tokens", [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(101)], 9, 8),
        Entry("tokenizer.ggml.token_type", [1] * 100 + [3], 9, 5),
        Entry("tokenizer.ggml.merges", ["a a"], 9, 8),
        Entry("tokenizer.ggml.eos_token_id", 100, 4),
        Entry("tokenizer.ggml.add_bos_token", False, 7),
        Entry("tokenizer.chat_template", "{{ messages }}", 8),
    ]
    path = save_gguf(tiny_llama(tie=True), tmp_path / "m.gguf", vocabulary=vocab)
    assert typed_metadata(path, ("tokenizer.",)) == vocab
    reader = gguf.GGUFReader(path)  # the gguf package's own reader agrees on the types
    assert reader.fields["tokenizer.ggml.eos_token_id"].types == [gguf.GGUFValueType.UINT32]
    assert reader.fields["tokenizer.ggml.token_type"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]


def test_a_changed_byte_is_refused_and_an_existing_file_survives_a_failed_write(tmp_path, monkeypatch):
    path = save_gguf(tiny_llama(tie=True), tmp_path / "m.gguf")
    blob = path.read_bytes()
    rng = np.random.default_rng(0)
    for at in [*rng.integers(0, len(blob), 12).tolist(), len(blob) - 1]:
        damaged = bytearray(blob)
        damaged[at] ^= 0x10
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(bytes(damaged))
        with pytest.raises(CheckpointError):
            from_gguf(bad, dtype=torch.float32)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("oneblock.io.gguf.writer._seal", full_disk)
    with pytest.raises(CheckpointError, match=r"disk is full.*previous file there is intact"):
        save_gguf(tiny_llama(tie=False), path)
    assert path.read_bytes() == blob
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_refusals(tmp_path):
    from oneblock.models.build import build_model
    from oneblock.presets import get_preset

    with pytest.raises(ConversionError, match=r"only Llama-family decoders.*differs"):
        save_gguf(build_model(get_preset("lesson")), tmp_path / "g.gguf")
    with pytest.raises(ConversionError, match=r"tensor type 'q4_0' is not supported; choose one of"):
        save_gguf(tiny_llama(tie=True), tmp_path / "m.gguf", tensor_type="q4_0")
    with pytest.raises(ConversionError, match=r"must be tokenizer.\* keys; got \['general.name'\]"):
        save_gguf(tiny_llama(tie=True), tmp_path / "m.gguf", vocabulary=[Entry("general.name", "x", 8)])
    model = tiny_llama(tie=True)
    apply_lora(model, LoraConfig(rank=2))
    with pytest.raises(ConversionError, match=r"has no place in a llama.cpp Llama.*merge LoRA adapters first"):
        save_gguf(model, tmp_path / "m.gguf")
    with pytest.raises(ConversionError, match=r"no LoRA adapters to write"):
        save_gguf_adapter(tiny_llama(tie=True), tmp_path / "a.gguf")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("rslora", [False, True])
def test_adapter_is_laid_out_as_llama_cpp_reads_it(tmp_path, rslora):
    model = tiny_llama(tie=True)
    cfg = LoraConfig(rank=3, alpha=5.0, rslora=rslora)
    apply_lora(model, cfg)
    gen = torch.Generator().manual_seed(2)
    for module in lora_modules(model).values():
        with torch.no_grad():
            module.lora_B.weight.copy_(torch.randn(module.lora_B.weight.shape, generator=gen))
    layout = read_layout(save_gguf_adapter(model, tmp_path / "a.gguf"))
    meta = layout.metadata
    assert (meta["general.type"], meta["general.architecture"], meta["adapter.type"]) == ("adapter", "llama", "lora")
    assert meta["adapter.lora.alpha"] == pytest.approx(cfg.scale * 3, rel=1e-7)  # llama.cpp scales by alpha / r
    assert len(layout.tensors) == 2 * 7 * 2
    for ours, module in lora_modules(model).items():
        base = gguf_name(f"{ours}.weight")
        a, b = (layout.tensors[f"{base}.lora_{x}"] for x in "ab")
        assert a.shape == (3, module.in_features) and b.shape == (module.out_features, 3)  # GGUF dims (in, r), (r, out)
        a_t, b_t = (torch.from_numpy(np.asarray(gguf.quants.dequantize(t.data.numpy(), Q.F32))) for t in (a, b))
        # the update llama.cpp adds to the stored (row-permuted) weight, put back in oneblock's row order,
        # is the oneblock adapter's own update
        delta = lora_delta(a_t.reshape(a.shape), b_t.reshape(b.shape), meta["adapter.lora.alpha"])
        if base.endswith((".attn_q.weight", ".attn_k.weight")):
            delta = unpermute_rows(delta, 4 if ".attn_q." in base else 2)
        torch.testing.assert_close(delta, module.delta_weight(), atol=1e-6, rtol=1e-5)


def test_a_phi3_adapter_on_stacked_matrices_is_written_on_phi3s_stacked_matrices(tmp_path):
    """Phi-3's qkv_proj and gate_up_proj adapters (A shared, B stacked, as peft makes them) stay whole on llama.cpp's
    attn_qkv and ffn_up, under the phi3 architecture, with the same updates."""
    transformers = pytest.importorskip("transformers")
    from oneblock.io.hf.convert import from_hf

    sizes = {"hidden_size": 36, "intermediate_size": 37, "num_attention_heads": 3, "num_key_value_heads": 1}
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "sliding_window": None}
    hf_cfg = transformers.Phi3Config(vocab_size=101, num_hidden_layers=2, **sizes, **ids)
    model = from_hf(transformers.Phi3ForCausalLM(hf_cfg))
    apply_lora(model, LoraConfig(rank=2, alpha=3.0))
    gen = torch.Generator().manual_seed(2)
    for module in lora_modules(model).values():
        with torch.no_grad():
            module.lora_B.weight.copy_(torch.randn(module.lora_B.weight.shape, generator=gen))
    layout = read_layout(save_gguf_adapter(model, tmp_path / "a.gguf"))
    assert layout.metadata["general.architecture"] == "phi3"
    assert len(layout.tensors) == 2 * 4 * 2  # attn_qkv, attn_output, ffn_up, ffn_down per layer, A and B each
    for i in range(2):
        for theirs, ours in (("attn_qkv", "attn.qkv_proj"), ("ffn_up", "ffn.w13")):
            fused = lora_modules(model)[f"blocks.{i}.{ours}"]
            a, b = (layout.tensors[f"blk.{i}.{theirs}.weight.lora_{x}"] for x in "ab")
            assert a.shape == (2, 36)  # peft's shared A, rank 2
            a_t, b_t = (torch.from_numpy(np.asarray(gguf.quants.dequantize(t.data.numpy(), Q.F32))) for t in (a, b))
            delta = lora_delta(a_t.reshape(a.shape), b_t.reshape(b.shape), layout.metadata["adapter.lora.alpha"])
            torch.testing.assert_close(delta, fused.delta_weight(), atol=1e-6, rtol=1e-5)


def test_an_option_no_architecture_states_is_refused_naming_each_architectures_difference(tmp_path):
    cfg = tiny_llama(tie=True).config.replace(no_rope_every=3)
    with pytest.raises(ConversionError, match=r"differs: llama \(Llama\): no_rope_every=3 .*smollm3 \(SmolLM3\): "
                       r"no_rope_every=3 \(llama.cpp's smollm3 skips rotary every 4 layers\)"):  # fmt: skip
        save_gguf(build_decoder(cfg), tmp_path / "m.gguf")
    assert not list(tmp_path.iterdir())
