"""``oneblock convert --to gguf``: a merged model (its tokenizer copied from the GGUF source or built from a Hugging
Face directory's tokenizer.json), ``--adapter-only``, and the refusals, on a small Llama-family GGUF file."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from cli_testing import one_line_error

from oneblock.adapters.apply import apply_lora, lora_modules, merge_lora
from oneblock.adapters.lora import LoraConfig
from oneblock.adapters.peft import save_adapter
from oneblock.cli.main import main
from oneblock.config import ModelConfig
from oneblock.inference.load import load_model
from oneblock.io.gguf.layout import read_layout
from oneblock.io.gguf.load import from_gguf
from oneblock.io.gguf.tokenizer import byte_alphabet
from oneblock.io.gguf.write import save_gguf
from oneblock.io.gguf.writer import Entry, typed_metadata
from oneblock.models.build import build_decoder

sys.path.insert(0, str(Path(__file__).parents[1] / "io" / "gguf"))
from converter_testing import made  # the random-weight models of tests/io/gguf

LLAMA = ModelConfig(
    vocab_size=258, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=96, max_seq_len=64, norm="rmsnorm",
    ffn="swiglu", position="rope", bias=False, activation="silu", tie_embeddings=True, norm_eps=2.0**-17,
)  # fmt: skip
# A byte-level BPE vocabulary small enough to write by hand: the 256 bytes, one merge, a control token.
TOKENS = [*byte_alphabet().values(), "aa", "<|end|>"]
VOCAB = [
    Entry("tokenizer.ggml.model", "gpt2", 8),
    Entry("tokenizer.ggml.pre", "smollm", 8),
    Entry("tokenizer.ggml.tokens", TOKENS, 9, 8),
    Entry("tokenizer.ggml.token_type", [1] * 257 + [3], 9, 5),
    Entry("tokenizer.ggml.merges", ["a a"], 9, 8),
    Entry("tokenizer.ggml.eos_token_id", 257, 4),
    Entry("tokenizer.chat_template", "{% for m in messages %}{{ m.content }}<|end|>{% endfor %}", 8),
]


@pytest.fixture(scope="module")
def source_and_adapter(tmp_path_factory):
    """A GGUF file with a vocabulary, a peft adapter for it (random B), and the merged float32 model."""
    root = tmp_path_factory.mktemp("convert_gguf")
    torch.manual_seed(0)
    save_gguf(build_decoder(LLAMA).eval(), root / "base.gguf", vocabulary=VOCAB)
    model = load_model(root / "base.gguf", dtype=torch.float32).model
    cfg = LoraConfig(rank=4, alpha=8.0, rslora=True)
    apply_lora(model, cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in lora_modules(model).values():
            module.lora_B.weight.copy_(0.5 * torch.randn(module.lora_B.weight.shape, generator=gen))
    save_adapter(model, root / "adapter", cfg=cfg)
    return root / "base.gguf", root / "adapter", merge_lora(model, unload=True)


def test_merged_model_reads_back_bit_equal_with_the_sources_tokenizer(source_and_adapter, tmp_path, capsys):
    source, adapter, merged = source_and_adapter
    out = tmp_path / "merged.gguf"
    argv = ["convert", "--model", str(source), "--adapter", str(adapter), "--to", "gguf", str(out), "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["bytes written"] == out.stat().st_size and summary["type"] == "f32"
    back = from_gguf(out, dtype=torch.float32).state_dict()
    for name, weight in merged.state_dict().items():
        assert torch.equal(back[name], weight), name
    assert typed_metadata(out, ("tokenizer.",)) == VOCAB
    assert load_model(out).tokenizer.encode("aab<|end|>") == load_model(source).tokenizer.encode("aab<|end|>")


def test_q8_0_and_positional_spelling(source_and_adapter, tmp_path):
    source, _, _ = source_and_adapter
    out = tmp_path / "q8.gguf"
    assert main(["convert", str(source), str(out), "--to", "gguf", "--type", "q8_0"]) == 0
    layout = read_layout(out)
    assert (
        layout.tensors["blk.0.ffn_down.weight"].ggml_type == 8 and layout.tensors["output_norm.weight"].ggml_type == 0
    )


def test_adapter_only_writes_a_llama_cpp_adapter(source_and_adapter, tmp_path):
    source, adapter, _ = source_and_adapter
    out = tmp_path / "adapter.gguf"
    assert main(["convert", str(source), str(out), "--adapter", str(adapter), "--to", "gguf", "--adapter-only"]) == 0
    layout = read_layout(out)
    assert layout.metadata["general.type"] == "adapter" and layout.metadata["adapter.type"] == "lora"
    assert layout.metadata["adapter.lora.alpha"] == pytest.approx(8.0 / 2.0 * 4)  # rsLoRA: scale alpha/sqrt(r), times r
    assert layout.tensors["blk.1.attn_k.weight.lora_b"].shape == (2 * 16, 4)
    assert layout.tensors["blk.1.attn_k.weight.lora_a"].shape == (4, 64)


def test_hf_directory_tokenizer_json_becomes_the_same_vocabulary(source_and_adapter, tmp_path, capsys):
    from oneblock.io.hf.convert import save_hf

    source, _, merged = source_and_adapter
    loaded = load_model(source)
    save_hf(merged, tmp_path / "hf")
    loaded.tokenizer.tokenizer.save(str(tmp_path / "hf" / "tokenizer.json"))
    config = {"eos_token": "<|end|>", "chat_template": VOCAB[-1].value}
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(config))
    out = tmp_path / "from-hf.gguf"
    assert main(["convert", str(tmp_path / "hf"), str(out), "--to", "gguf"]) == 0
    written = {e.key: e.value for e in typed_metadata(out, ("tokenizer.",))}
    for entry in VOCAB:
        assert written[entry.key] == entry.value, entry.key


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--adapter-only"], "--adapter-only writes the adapter given by --adapter DIR"),
        (["--dtype", "float16"], "for --to gguf say --type f32, f16, bf16 or q8_0"),
        (["--adapter", "ADAPTER", "--adapter-only", "--type", "q8_0"], "writes f32 or f16 LoRA tensors"),
    ],
)
def test_refusals_are_one_line(source_and_adapter, tmp_path, capsys, extra, match):
    source, adapter, _ = source_and_adapter
    extra = [str(adapter) if x == "ADAPTER" else x for x in extra]
    code = main(["convert", str(source), str(tmp_path / "o.gguf"), "--to", "gguf", *extra])
    assert match in one_line_error(capsys, code)


def test_existing_output_preset_source_and_double_source_are_refused(source_and_adapter, tmp_path, capsys):
    source, _, _ = source_and_adapter
    (tmp_path / "o.gguf").write_bytes(b"keep")
    code = main(["convert", str(source), str(tmp_path / "o.gguf"), "--to", "gguf"])
    assert "already exists; pass --force" in one_line_error(capsys, code)
    assert (tmp_path / "o.gguf").read_bytes() == b"keep"
    code = main(["convert", "--model", str(source), str(source), str(tmp_path / "p.gguf"), "--to", "gguf"])
    assert "give the source once" in one_line_error(capsys, code)
    code = main(["convert", str(source), str(tmp_path / "p.gguf"), "--to-hf", "--to", "gguf"])
    assert "--to-hf and --to set the same thing; give one of them" in one_line_error(capsys, code)
    code = main(["convert", str(source), str(tmp_path / "p"), "--to", "hf", "--type", "f16"])
    assert "add --to gguf" in one_line_error(capsys, code)
    checkpoint = tmp_path / "m.safetensors"
    from oneblock.io.checkpoint import save

    save(from_gguf(source, dtype=torch.float32), checkpoint)
    code = main(["convert", str(checkpoint), str(tmp_path / "c.gguf"), "--to", "gguf"])
    assert "carries no tokenizer llama.cpp can use" in one_line_error(capsys, code)


def test_an_empty_metadata_array_is_copied_and_reads_back(tmp_path, capsys):
    """GGUF allows an array of no items (item type, count 0); gguf's GGUFWriter refuses to pack one."""
    gguf = pytest.importorskip("gguf")
    vocab = [*VOCAB, Entry("tokenizer.ggml.added_tokens", [], 9, 8)]  # legal, and oneblock loads it
    torch.manual_seed(0)
    save_gguf(build_decoder(LLAMA).eval(), tmp_path / "source.gguf", vocabulary=vocab)
    out = tmp_path / "copy.gguf"
    assert main(["convert", "--model", str(tmp_path / "source.gguf"), "--to", "gguf", str(out)]) == 0, (
        capsys.readouterr()
    )
    assert typed_metadata(out, ("tokenizer.",)) == vocab
    field = gguf.GGUFReader(out).fields["tokenizer.ggml.added_tokens"]  # llama.cpp's own reader
    assert field.types == [gguf.GGUFValueType.ARRAY] and field.contents() == []
    assert load_model(out).tokenizer.encode("aab") == load_model(tmp_path / "source.gguf").tokenizer.encode("aab")


@pytest.mark.parametrize("link", [False, True])
def test_a_fifo_destination_is_refused_even_with_force(source_and_adapter, tmp_path, capsys, link):
    source, _, _ = source_and_adapter
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    dst = tmp_path / "link.gguf" if link else fifo
    if link:
        dst.symlink_to(fifo)
    code = main(["convert", "--model", str(source), str(dst), "--to", "gguf", "--force"])
    assert re.search(r"cannot write the GGUF file to '.*': it is a FIFO", one_line_error(capsys, code))
    assert fifo.is_fifo() and dst.is_symlink() == link


def test_the_gguf_writer_refuses_a_fifo(tmp_path):
    from oneblock.errors import CheckpointError

    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(CheckpointError, match=r"it is a FIFO \(named pipe\), not a regular file"):
        save_gguf(build_decoder(LLAMA).eval(), tmp_path / "pipe", vocabulary=VOCAB)
    assert (tmp_path / "pipe").is_fifo() and sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_a_qwen2_directory_becomes_a_qwen2_file_computing_its_logits(tmp_path, capsys):
    from oneblock.io.hf.convert import from_hf

    source, out = made("qwen2"), tmp_path / "qwen2.gguf"
    assert main(["convert", "--model", str(source), "--to", "gguf", str(out)]) == 0, capsys.readouterr()
    layout = read_layout(out)
    assert layout.metadata["general.architecture"] == "qwen2" and "blk.0.attn_q.bias" in layout.tensors
    assert layout.metadata["tokenizer.ggml.pre"] == "qwen2"  # Qwen2's digit-by-digit split, as the converter names it
    ids = torch.randint(0, 151936, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = from_hf(source)(ids)[0], from_gguf(out, dtype=torch.float32)(ids)[0]
    assert (got - want).abs().max() <= 1e-5 * (want.max() - want.min())


def test_a_family_no_gguf_architecture_holds_is_refused_in_one_line(tmp_path, capsys):
    from oneblock.io.hf.convert import save_hf
    from oneblock.models.build import build_model
    from oneblock.presets import get_preset

    save_hf(build_model(get_preset("lesson")), tmp_path / "gpt2")
    code = main(["convert", str(tmp_path / "gpt2"), str(tmp_path / "o.gguf"), "--to", "gguf"])
    assert "only Llama-family decoders (llama, qwen2, qwen3" in one_line_error(capsys, code)
    assert not (tmp_path / "o.gguf").exists()
