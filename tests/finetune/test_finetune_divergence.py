"""A diverging fine-tuning run stops at its first non-finite loss (exit 2, one line naming the step and the loss),
writes no adapter and keeps its last finite checkpoint; a DPO beta whose loss overflows is refused up front."""

from __future__ import annotations

import json
import re

import pytest
import torch
from finetune_testing import PAIRS, pair_records, tiny_llama_checkpoint, write_jsonl
from safetensors.torch import load_file

from oneblock.cli.main import main
from oneblock.errors import ConfigError
from oneblock.finetune.preference import MAX_BETA, check_beta
from oneblock.finetune.run import FinetuneConfig


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("base") / "base.safetensors")


def _one_line(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _finetune(base, data, out, *extra: str) -> list[str]:
    return ["finetune", "--model", str(base), "--data", str(data), "--out", str(out), "--steps", "4", "--seq-len",
            "16", "--warmup", "0", "--save-every", "1", "--keep", "2", "--quiet", "--json", *extra]  # fmt: skip


def test_a_diverging_run_stops_at_the_first_nan_loss_and_keeps_the_last_finite_checkpoint(tmp_path, base, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", pair_records())
    out = tmp_path / "run"
    err = _one_line(capsys, main(_finetune(base, data, out, "--lr", "1e30")))
    assert re.search(r"step 2: .*training loss is nan.*step-000001, is kept.*lower --lr \(1e\+30\)", err), err
    assert not (out / "adapter_model.safetensors").exists() and not (out / "adapter_config.json").exists()
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-000001"]
    weights = load_file(out / "checkpoints" / "step-000001" / "trainable.safetensors")
    assert weights and all(torch.isfinite(t).all() for t in weights.values())
    steps = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1] and steps[0]["loss"] > 0  # the diverged step is not logged as trained


def test_an_update_that_makes_weights_non_finite_saves_nothing(tmp_path, base, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", pair_records())
    out = tmp_path / "run"
    err = _one_line(capsys, main(_finetune(base, data, out, "--lr", "1e39")))  # past float32's range
    assert re.search(r"step 1: .*update made weights non-finite.*no checkpoint was written.*lower --lr", err), err
    assert not (out / "checkpoints").exists() and not (out / "adapter_model.safetensors").exists()


def test_dpo_beta_whose_loss_overflows_is_refused(tmp_path, base, capsys):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "chosen": c, "rejected": c[::-1]} for p, c in PAIRS])
    out = tmp_path / "run"
    err = _one_line(capsys, main([*_finetune(base, data, out, "--method", "dpo"), "--beta", "1e308"]))
    assert "--beta must be at most 1000; got 1e+308" in err
    assert not out.exists()
    assert check_beta(MAX_BETA) == MAX_BETA
    with pytest.raises(ConfigError, match=r"beta must be at most 1000; got 1001"):
        FinetuneConfig(model="m", data="d", method="dpo", beta=1001.0)


def test_a_batch_larger_than_the_data_is_cut_to_it_and_told(tmp_path, base, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", pair_records())
    out = tmp_path / "run"
    assert main([*_finetune(base, data, out), "--steps", "1", "--batch-size", "100000"]) == 0
    err = capsys.readouterr().err
    assert "--batch-size 100000 is more than the 4 training examples; each micro-batch holds 4" in err
    assert json.loads((out / "config.json").read_text())["train"]["batch_size"] == 4
    steps = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if '"loss"' in line]
    assert steps[0]["tokens"] == sum(len(p + c) - 1 for p, c in PAIRS)  # the inputs of each example once


def test_a_lora_rank_above_a_layers_width_is_refused_naming_both(tmp_path, base, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", pair_records())
    err = _one_line(capsys, main([*_finetune(base, data, tmp_path / "run"), "--lora-rank", "1000000000"]))
    assert "LoRA rank 1000000000 is above the width of layer 'blocks.0.attn.k_proj' (48 in, 16 out)" in err
    assert err.endswith("choose a LoRA rank of at most 16")
    assert main([*_finetune(base, data, tmp_path / "ok"), "--steps", "1", "--lora-rank", "16"]) == 0
