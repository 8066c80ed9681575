"""``oneblock finetune --method dpo`` end to end on a small Llama-family model: the preference is learnt, the log
carries the reward margin and accuracy, the reference is the base (adapters off, no copy; or a frozen copy), and
bad pairs are refused by file and line."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from finetune_testing import tiny_llama_checkpoint, write_jsonl

from oneblock.adapters.apply import adapters_disabled, apply_lora, lora_modules, merge_lora
from oneblock.adapters.lora import LoraConfig
from oneblock.cli.main import main
from oneblock.finetune.preference import PreferenceObjective
from oneblock.finetune.run import FinetuneConfig, prepare
from oneblock.train.config import TrainConfig

# Chosen answers end with "!", rejected ones with "?": a preference the random base does not hold.
PAIRS = [{"prompt": f"{w}>", "chosen": f"{w}!", "rejected": f"{w}?"} for w in ("ab", "cd", "ef", "gh", "ij", "kl")]


@pytest.fixture
def base(tmp_path):
    return tiny_llama_checkpoint(tmp_path / "base.safetensors")


def test_disabled_adapters_give_the_base_exactly():
    from oneblock.models import build_model
    from oneblock.presets import get_preset

    cfg = get_preset("smollm2-135m").replace(vocab_size=64, d_model=24, n_heads=3, n_kv_heads=1, n_layers=2,
                                             d_ff=40, max_seq_len=16)  # fmt: skip
    torch.manual_seed(0)
    plain = build_model(cfg).eval()
    adapted = apply_lora(copy.deepcopy(plain), LoraConfig(rank=2, alpha=4))
    for module in lora_modules(adapted).values():
        torch.nn.init.normal_(module.lora_B.weight)
    tokens = torch.randint(0, 64, (2, 9))
    assert not torch.equal(adapted(tokens), plain(tokens))
    with adapters_disabled(adapted):
        assert torch.equal(adapted(tokens), plain(tokens))
    assert not torch.equal(adapted(tokens), plain(tokens))  # switched back on
    merge_lora(adapted)
    with pytest.raises(Exception, match="cannot disable merged LoRA adapters"):
        adapters_disabled(adapted).__enter__()


def test_lora_reference_is_the_model_itself_and_full_keeps_a_frozen_copy(tmp_path, base):
    data = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    cfg = TrainConfig(task="finetune", steps=1, seq_len=16, batch_size=2, warmup_steps=0)
    lora = prepare(FinetuneConfig(model=str(base), data=str(data), method="dpo"), cfg, run_dir=None, device="cpu")
    assert isinstance(lora.trainer.objective, PreferenceObjective) and lora.trainer.objective.reference is None
    full = prepare(FinetuneConfig(model=str(base), data=str(data), method="dpo-full"), cfg, run_dir=None, device="cpu")
    reference = full.trainer.objective.reference
    assert reference is not None and not any(p.requires_grad for p in reference.parameters())
    before = {k: v.clone() for k, v in reference.state_dict().items()}
    full.trainer.train()
    assert all(torch.equal(before[k], v) for k, v in reference.state_dict().items())  # frozen
    assert any(not torch.equal(before[k], v) for k, v in full.trainer.model.state_dict().items())  # the policy moved


@pytest.mark.parametrize("method", ["dpo", "dpo-full"])
def test_dpo_learns_the_preference_and_logs_margins_and_accuracy(tmp_path, base, capsys, method):
    data = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    out = tmp_path / "run"
    lr = "3e-2" if method == "dpo" else "3e-3"
    argv = ["finetune", "--model", str(base), "--data", str(data), "--eval", str(data), "--out", str(out),
            "--method", method, "--beta", "0.5", "--steps", "30", "--lr", lr, "--seq-len", "16", "--batch-size", "3",
            "--quiet", "--json"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "eval" not in r]
    assert len(steps) == 30 and all({"reward_margin", "reward_accuracy"} <= set(r) for r in steps)
    assert steps[0]["reward_margin"] == 0.0 and steps[0]["loss"] == pytest.approx(0.693147, abs=1e-5)  # pi = ref
    assert steps[-1]["reward_margin"] > 0 and steps[-1]["reward_accuracy"] == 1.0
    scores = summary["eval"]
    assert scores["reward_accuracy"] == 1.0 and scores["preference_accuracy"] == 1.0 and scores["loss"] < 0.6931
    product = "adapter_model.safetensors" if method == "dpo" else "model.safetensors"
    assert (out / product).is_file()


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"prompt": "a", "chosen": "b"}', r"p\.jsonl:2: a preference pair is"),
        ('{"prompt": "a", "messages": [], "chosen": "b", "rejected": "c"}', "exactly one of 'prompt' and 'messages'"),
        ('{"prompt": "a", "chosen": "", "rejected": "c"}', r"'chosen' must be a non-empty string"),
        ('{"messages": [{"role": "assistant", "content": "x"}], "chosen": "b", "rejected": "c"}', "end with the user"),
        ("{not json", r"p\.jsonl:2 is not JSON"),
    ],
)
def test_bad_pairs_give_one_line_naming_file_and_line(tmp_path, base, capsys, line, match):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps(PAIRS[0]) + "\n" + line + "\n")
    argv = ["finetune", "--model", str(base), "--data", str(data), "--out", str(tmp_path / "r"), "--method", "dpo",
            "--steps", "1", "--seq-len", "16", "--quiet"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(match, err[0]), err


def test_dpo_refuses_packing_and_bad_beta(tmp_path, base, capsys):
    data = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    common = ["finetune", "--model", str(base), "--data", str(data), "--out", str(tmp_path / "r"), "--method", "dpo"]
    assert main([*common, "--pack"]) == 2
    assert "drop --pack" in capsys.readouterr().err
    assert main([*common, "--beta", "0"]) == 2
    assert "--beta must be a finite number > 0; got 0.0" in capsys.readouterr().err
