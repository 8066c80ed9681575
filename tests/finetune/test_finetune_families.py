"""``oneblock finetune`` with LoRA on Hugging Face directories of every decoder family beyond Llama 2: Qwen2 (q/k/v
biases), Qwen3 (q/k norms, a head width of its own), Llama 3 (its rope scaling), Granite (its multipliers), SmolLM3
(layers without rope), OLMo 2 (norms after the sublayers, q/k norms), Phi-3 (stacked ``qkv_proj`` and
``gate_up_proj``, adapted whole), Gemma 2 and Gemma 3. The loss goes down, and peft loads the adapter onto the
transformers model of the directory and computes the logits oneblock computes with it."""

from __future__ import annotations

import json

import pytest
import torch
from finetune_testing import pair_records, write_jsonl

from oneblock.adapters.peft import load_adapter
from oneblock.cli.main import main
from oneblock.io.hf.convert import from_hf

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SIZES = {
    "vocab_size": 256, "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 3,
    "num_key_value_heads": 1, "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": None,
    "eos_token_id": None, "attn_implementation": "eager",
}  # fmt: skip
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}  # fmt: skip
# Granite's multipliers; its logits scaled up (a divisor of 8, as in the published models, leaves the near-uniform
# logits of the default initialisation too flat to learn from in 20 steps)
GRANITE = {
    "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 0.5, "attention_multiplier": 0.0625,
}  # fmt: skip
GEMMA = {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 24}
CONFIGS = {
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 24}),
    "llama3": ("LlamaConfig", {"rope_parameters": LLAMA3_ROPE}),
    "granite": ("GraniteConfig", GRANITE),
    "smollm3": ("SmolLM3Config", {"no_rope_layer_interval": 2}),
    "olmo2": ("Olmo2Config", {}),
    "phi3": ("Phi3Config", {"sliding_window": None, "original_max_position_embeddings": 64}),
    "gemma2": ("Gemma2Config", GEMMA),
    "gemma3": ("Gemma3TextConfig", {**GEMMA, "layer_types": ["sliding_attention", "full_attention"]}),
}
LLAMA_NAMES = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
TARGETS = {family: LLAMA_NAMES for family in CONFIGS} | {"phi3": ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_lora_finetune_of_a_hf_directory_learns_and_peft_loads_it(family, tmp_path, capsys):
    config_class, options = CONFIGS[family]
    torch.manual_seed(0)
    hf_config = getattr(transformers, config_class)(**SIZES, **options)
    transformers.AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path / "base")  # bytes: no tokenizer
    data = write_jsonl(tmp_path / "d.jsonl", pair_records())
    out = tmp_path / "run"
    argv = ["finetune", "--model", str(tmp_path / "base"), "--data", str(data), "--out", str(out),
            "--steps", "20", "--lr", "1e-2", "--seq-len", "16", "--quiet", "--json"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    losses = [row["loss"] for row in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if row.get("loss")]
    assert len(losses) == 20 and losses[-1] < 0.9 * losses[0], losses
    assert sorted(json.loads((out / "adapter_config.json").read_text())["target_modules"]) == TARGETS[family]

    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")
    theirs = peft.PeftModel.from_pretrained(base.float(), str(out)).eval()
    ours = from_hf(tmp_path / "base")
    load_adapter(ours, out)
    ids = torch.tensor([list(b"cat>tac.dog>")])
    with torch.no_grad():
        expected, got = theirs(ids).logits, ours(ids)
        plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")
        assert (got - plain(ids).logits).abs().max() > 1e-3  # the trained adapter changes the model
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
