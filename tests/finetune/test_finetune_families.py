"""``oneblock finetune`` with LoRA on Hugging Face directories of the families beyond Llama: Gemma 2 (Llama's module
names) and Phi-3 (stacked ``qkv_proj`` and ``gate_up_proj``, adapted whole). The loss goes down, and peft loads the
adapter onto the transformers model of the directory and computes the logits oneblock computes with it."""

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
CONFIGS = {
    "gemma2": ("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 24}),
    "phi3": ("Phi3Config", {"sliding_window": None, "original_max_position_embeddings": 64}),
}
TARGETS = {"gemma2": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
           "phi3": ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]}  # fmt: skip


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
