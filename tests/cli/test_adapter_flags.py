"""The LoRA flags of the commands: ``count --lora-rank``, ``generate/explore --adapter [--merge]``,
``convert --adapter --to hf``, and ``generate --model`` beside its old spelling ``--checkpoint``."""

from __future__ import annotations

import json
import re

import pytest
import torch
from cli_testing import one_line_error

from oneblock import build_model, generate, load_model
from oneblock.adapters.apply import apply_lora, lora_modules, merge_lora
from oneblock.adapters.lora import LoraConfig
from oneblock.adapters.peft import save_adapter
from oneblock.cli.main import main
from oneblock.config import ModelConfig
from oneblock.io.checkpoint import save
from oneblock.text.tokenizer import ByteTokenizer

PROMPT = "the block"
# A Llama-family decoder over bytes: small, and with a peft name for every adapted layer.
LLAMA = ModelConfig(
    vocab_size=260, d_model=36, n_heads=3, n_kv_heads=1, n_layers=2, d_ff=37, max_seq_len=64, norm="rmsnorm",
    ffn="swiglu", position="rope", bias=False, activation="silu", tie_embeddings=False,
)  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint_and_adapter(tmp_path_factory):
    """A oneblock checkpoint, a peft adapter for it (random B), and the adapted model as the reference."""
    root = tmp_path_factory.mktemp("adapted")
    torch.manual_seed(0)
    model = build_model(LLAMA).eval()
    save(model, root / "model.safetensors")
    cfg = LoraConfig(rank=4, alpha=8.0)
    apply_lora(model, cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in lora_modules(model).values():
            module.lora_B.weight.copy_(0.5 * torch.randn(module.lora_B.weight.shape, generator=gen))
    save_adapter(model, root / "adapter", cfg=cfg, base="model.safetensors")
    return root / "model.safetensors", root / "adapter", model


def test_count_prints_the_trainable_adapter_parameters(capsys):
    assert main(["count", "--preset", "smollm2-135m", "--lora-rank", "8"]) == 0
    out = capsys.readouterr().out
    assert "LoRA rank 8 (trainable)" in out and "2,442,240" in out and "1.82% of the base" in out


def test_count_json_and_verify_across_families(capsys):
    for preset, targets in (("gpt2", "all-linear"), ("bart-base", "q,k,v,o"), ("t5-v1_1-small", "gate,down")):
        argv = ["count", "--preset", preset, "--lora-rank", "3", "--lora-targets", targets, "--verify", "--json"]
        assert main(argv) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["verified"] and data["lora"]["measured"] == data["lora"]["trainable"] > 0


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--lora-rank", "0"], r"rank must be an integer >= 1; got 0"),
        (["--lora-rank", "4", "--lora-targets", "q,nope"], r"unknown LoRA target\(s\) \['nope'\]"),
    ],
)
def test_count_refuses_bad_lora_flags(capsys, argv, match):
    code = main(["count", "--preset", "smollm2-135m", *argv])
    assert re.search(match, one_line_error(capsys, code))


@pytest.mark.parametrize("flag", ["--model", "--checkpoint"])
def test_generate_with_an_adapter_equals_the_library(checkpoint_and_adapter, capsys, flag):
    path, adapter, model = checkpoint_and_adapter
    argv = ["generate", flag, str(path), "--adapter", str(adapter), "--prompt", PROMPT, "--greedy"]
    assert main([*argv, "--max-new-tokens", "16"]) == 0
    out = capsys.readouterr().out
    ids = generate(model, ByteTokenizer().encode(PROMPT), 16, greedy=True)
    assert out == ByteTokenizer().decode(ids.tolist()) + "\n"
    base = generate(load_model(path).model, ByteTokenizer().encode(PROMPT), 16, greedy=True)
    assert ids.tolist() != base.tolist()  # the adapter changes the text


def test_generate_merged_equals_unmerged(checkpoint_and_adapter, capsys):
    path, adapter, _ = checkpoint_and_adapter
    argv = ["generate", "--model", str(path), "--adapter", str(adapter), "--prompt", PROMPT, "--greedy", "--json"]
    assert main(argv) == 0
    unmerged = json.loads(capsys.readouterr().out)["new_ids"]
    assert main([*argv, "--merge"]) == 0
    assert json.loads(capsys.readouterr().out)["new_ids"] == unmerged


def test_merge_without_adapter_is_one_line(checkpoint_and_adapter, capsys):
    path, _, _ = checkpoint_and_adapter
    code = main(["generate", "--model", str(path), "--prompt", "x", "--merge"])
    assert "--merge folds an adapter into the weights; give --adapter DIR too" in one_line_error(capsys, code)


def test_adapter_for_another_model_is_one_line(checkpoint_and_adapter, tmp_path, capsys):
    _, adapter, _ = checkpoint_and_adapter
    other = build_model(LLAMA.replace(d_model=48))
    save(other, tmp_path / "other.safetensors")
    other_path = str(tmp_path / "other.safetensors")
    code = main(["generate", "--model", other_path, "--adapter", str(adapter), "--prompt", "x"])
    assert "was made for another base" in one_line_error(capsys, code)


def test_serve_runs_the_adapted_model(checkpoint_and_adapter, monkeypatch):
    from oneblock.serve import server

    ckpt, adapter, reference = checkpoint_and_adapter
    served = {}
    monkeypatch.setattr(server, "serve", lambda engine, **options: served.update(engine=engine))
    argv = ["serve", "--model", str(ckpt), "--adapter", str(adapter), "--embedding-model", "none", "--port", "0"]
    assert main(argv) == 0
    model = served["engine"].decoder.model
    assert lora_modules(model)  # unmerged: the adapters are there
    ids = torch.tensor([[5, 17, 3, 99, 42]])
    with torch.no_grad():
        assert torch.allclose(model(ids), reference(ids), atol=1e-5, rtol=0)


def test_serve_named_adapters_are_served_per_request(checkpoint_and_adapter, monkeypatch):
    from oneblock.adapters.multi import MultiLoraLinear
    from oneblock.serve import server

    ckpt, adapter, reference = checkpoint_and_adapter
    served = {}
    monkeypatch.setattr(server, "serve", lambda engine, **options: served.update(engine=engine, **options))
    argv = ["serve", "--model", str(ckpt), "--adapter", f"one={adapter}", "--adapter", f"two={adapter}",
            "--embedding-model", "none", "--port", "0"]  # fmt: skip
    assert main(argv) == 0
    engine = served["engine"]
    assert engine.adapters.names == ("one", "two") and served["model_name"] == "model"
    model = engine.decoder.model
    assert not lora_modules(model) and any(isinstance(m, MultiLoraLinear) for m in model.modules())
    ids = torch.tensor([[5, 17, 3, 99, 42]])
    engine.adapters.rows.select([2])
    with torch.no_grad():
        assert torch.allclose(model(ids), reference(ids), atol=1e-5, rtol=0)  # adapter two is the adapter
    engine.close(grace=1)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--adapter", "{a}", "--adapter", "x={a}"], "give one DIR (the model runs with it), or NAME=DIR for each"),
        (["--adapter", "{a}", "--adapter", "{a}"], "give one DIR"),
        (["--adapter", "x={a}", "--adapter", "x={a}"], "each NAME once"),
        (["--adapter", "x={a}", "--merge"], "--merge folds one adapter into the weights"),
        (["--adapter", "model={a}"], "'model' is the base model's name"),
        (["--adapter", " x={a}"], "a name without spaces around it"),
    ],
)
def test_serve_adapter_flags_refused_in_one_line(checkpoint_and_adapter, monkeypatch, capsys, flags, message):
    from oneblock.serve import server

    ckpt, adapter, _ = checkpoint_and_adapter
    monkeypatch.setattr(server, "serve", lambda engine, **options: pytest.fail("served"))
    argv = ["serve", "--model", str(ckpt), *(f.format(a=adapter) for f in flags), "--embedding-model", "none"]
    assert message in one_line_error(capsys, main(argv))


def test_convert_merges_the_adapter_into_a_directory_transformers_loads(checkpoint_and_adapter, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    path, adapter, model = checkpoint_and_adapter
    out = tmp_path / "merged"
    assert main(["convert", str(path), str(out), "--adapter", str(adapter), "--to", "hf"]) == 0
    assert "merged" in capsys.readouterr().out
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    merged = merge_lora(load_model(path, adapter=adapter).model, unload=True)
    x = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (theirs(x).logits - merged(x)).abs().max() <= 1e-5
        assert (theirs(x).logits - model(x)).abs().max() <= 1e-5  # and the unmerged adapted model


def test_explore_page_with_an_adapter(checkpoint_and_adapter, tmp_path, capsys):
    path, adapter, _ = checkpoint_and_adapter
    out = tmp_path / "page.html"
    argv = ["explore", "--checkpoint", str(path), "--adapter", str(adapter), "--html", str(out), "--text", "abc"]
    assert main(argv) == 0
    assert "adapter" in out.read_text()


def test_chat_with_an_adapter_answers_as_the_adapted_model(tmp_path, capsys):
    """``chat --adapter`` on SmolLM2 (exact float32): the answer equals a chat session over the adapted model."""
    pytest.importorskip("gguf")
    from oneblock.errors import CheckpointError
    from oneblock.inference.chat import ChatSession
    from oneblock.inference.smollm2 import smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except CheckpointError as error:
        pytest.skip(str(error))
    loaded = load_model(path, dtype=torch.float32)
    question = "What is the capital of France?"
    base_answer = "".join(ChatSession(loaded.model, loaded.tokenizer, max_new_tokens=8).stream(question))
    cfg = LoraConfig(rank=2, alpha=4.0, targets=("v", "down"))
    apply_lora(loaded.model, cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in lora_modules(loaded.model).values():
            module.lora_B.weight.copy_(3.0 * torch.randn(module.lora_B.weight.shape, generator=gen))
    save_adapter(loaded.model, tmp_path, cfg=cfg)
    argv = ["chat", question, "--temperature", "0", "--max-new-tokens", "8", "--exact"]
    assert main([*argv, "--adapter", str(tmp_path)]) == 0
    answer = capsys.readouterr().out
    session = ChatSession(loaded.model, loaded.tokenizer, max_new_tokens=8)  # greedy, as temperature 0
    assert answer == "".join(session.stream(question)) + "\n"
    assert answer != base_answer + "\n"


def test_convert_a_gguf_file_with_its_adapter_for_transformers(tmp_path, capsys):
    """SmolLM2's GGUF file + an adapter -> a merged Hugging Face directory: transformers' logits equal the unmerged
    adapted model's, and its greedy tokens are oneblock's."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from oneblock.errors import CheckpointError
    from oneblock.inference.smollm2 import smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except CheckpointError as error:
        pytest.skip(str(error))
    adapted = load_model(path, dtype=torch.float32).model
    cfg = LoraConfig(rank=2, alpha=4.0, targets=("q", "k", "up"))
    apply_lora(adapted, cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in lora_modules(adapted).values():
            module.lora_B.weight.copy_(0.05 * torch.randn(module.lora_B.weight.shape, generator=gen))
    save_adapter(adapted, tmp_path / "adapter", cfg=cfg)
    out = tmp_path / "merged"
    assert main(["convert", str(path), str(out), "--adapter", str(tmp_path / "adapter"), "--to", "hf", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["arch"] == "decoder"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = [1, 9690, 198, 504, 3575, 282, 4649]
    with torch.no_grad():
        x = torch.tensor([prompt])
        assert (theirs(x).logits - adapted(x)).abs().max() <= 1e-4
        greedy = theirs.generate(x, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(x))
    ours = generate(adapted, prompt, 12, greedy=True)
    assert greedy[0].tolist() == ours.tolist()
