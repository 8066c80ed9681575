"""SmolLM2-135M-Instruct fine-tuned from its GGUF file on chat data: the adapter oneblock writes, loaded by peft on
transformers' model from the same file, gives oneblock's logits within 1e-4."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from finetune_testing import chat, write_jsonl

from oneblock.cli.main import main

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

CHATS = [
    chat("Reverse the word: lamp", "pmal"),
    chat("Reverse the word: stone", "enots"),
    chat("Reverse the word: river", "revir"),
    chat("Reverse the word: cloud", "duolc"),
]


def test_smollm2_lora_adapter_loads_in_peft_with_the_same_logits(tmp_path, capsys):
    from oneblock.adapters.peft import load_adapter
    from oneblock.inference.load import load_model
    from oneblock.inference.smollm2 import smollm2_gguf_path

    path = smollm2_gguf_path()
    data = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    out = tmp_path / "run"
    argv = ["finetune", "--model", str(path), "--dtype", "float32", "--data", str(data), "--out", str(out),
            "--steps", "2", "--batch-size", "2", "--seq-len", "64", "--rank", "4", "--lr", "1e-2", "--pack",
            "--quiet", "--json"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    # rank 4 on q, o (576 -> 576), k, v (576 -> 192) and gate, up, down (576 <-> 1536) of 30 layers
    assert summary["trainable_parameters"] == 4 * 30 * (2 * (576 + 576) + 2 * (576 + 192) + 3 * (576 + 1536))
    assert 0 < summary["final_train_loss"] < 20

    ours = load_model(path, dtype=torch.float32).model
    load_adapter(ours, out)
    assert any(m.lora_B.weight.abs().sum() > 0 for m in ours.modules() if hasattr(m, "lora_B"))  # it trained
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        theirs = peft.PeftModel.from_pretrained(hf, str(out)).eval()
    complaints = [str(w.message) for w in caught if "key" in str(w.message).lower()]  # missing / unexpected keys
    assert not complaints, complaints
    tokens = torch.tensor([[1, 9690, 198, 19556, 260, 1345, 42, 2]])
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens), theirs(tokens).logits, atol=1e-4, rtol=0)
