"""Fine-tuning runs end to end on a small Llama-family model: memorised examples come back exactly under greedy
decoding (full and LoRA), only what should train changes, and bad settings are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from finetune_testing import PAIRS, greedy_completion, pair_records, tiny_llama_checkpoint, write_jsonl

from oneblock.adapters.lora import LoraConfig
from oneblock.cli.main import main
from oneblock.errors import ConfigError, InputError
from oneblock.finetune.run import FinetuneConfig, prepare, read_run
from oneblock.io.checkpoint import load
from oneblock.train.config import TrainConfig


@pytest.fixture
def base(tmp_path):
    return tiny_llama_checkpoint(tmp_path / "base.safetensors")


def test_full_finetune_memorises_examples(tmp_path, base, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", pair_records())
    out = tmp_path / "run"
    argv = ["finetune", "--model", str(base), "--data", str(data), "--out", str(out), "--method", "full",
            "--steps", "60", "--lr", "1e-2", "--seq-len", "16", "--quiet", "--json"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["trainable_parameters"] == summary["parameters"]
    model = load(out / "model.safetensors")
    for prompt, completion in PAIRS:
        assert greedy_completion(model, prompt, len(completion)) == completion


def test_lora_memorises_examples_and_trains_only_adapters(tmp_path, base):
    data = write_jsonl(tmp_path / "d.jsonl", pair_records())
    ft = FinetuneConfig(model=str(base), data=str(data), lora=LoraConfig(rank=8, alpha=16))
    cfg = TrainConfig(task="finetune", steps=200, lr=1e-2, seq_len=16, batch_size=4, warmup_steps=10, weight_decay=0.0)
    run = prepare(ft, cfg, run_dir=None, device="cpu")
    before = {k: v.clone() for k, v in run.trainer.model.state_dict().items()}
    run.trainer.train()
    after = run.trainer.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_A." in k or ".lora_B." in k for k in changed)
    for prompt, completion in PAIRS:
        assert greedy_completion(run.trainer.model, prompt, len(completion)) == completion


def test_held_out_share_is_scored(tmp_path, base):
    records = [{"prompt": f"{i}>", "completion": f"{i}{i}."} for i in range(10)]
    data = write_jsonl(tmp_path / "d.jsonl", records)
    ft = FinetuneConfig(model=str(base), data=str(data), eval_share=0.2)
    cfg = TrainConfig(task="finetune", steps=2, seq_len=16, batch_size=2, warmup_steps=0)
    run = prepare(ft, cfg, run_dir=None, device="cpu")
    assert run.n_examples == 8
    scores = run.trainer.train().eval
    assert set(scores) == {"loss", "accuracy"} and scores["loss"] > 0


def test_full_finetune_of_4bit_weights_refused(tmp_path):
    from oneblock.inference.smollm2 import smollm2_gguf_path

    data = write_jsonl(tmp_path / "d.jsonl", pair_records())
    ft = FinetuneConfig(model=str(smollm2_gguf_path()), data=str(data), method="full")
    with pytest.raises(ConfigError, match=r"full fine-tuning needs float weights.*dtype='float32'"):
        prepare(ft, TrainConfig(task="finetune", steps=1, seq_len=64, warmup_steps=0), run_dir=None)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--rank", "0"], "LoRA rank must be an integer >= 1; got 0"),
        (["--alpha", "-1"], "LoRA alpha must be a finite number > 0"),
        (["--targets", "q,nope"], "nope"),
        (["--eval-share", "1.5"], r"--eval-share must lie in \[0, 1\)"),
        (["--seq-len", "4"], r"examples are longer than --seq-len 4 tokens"),
    ],
)
def test_bad_settings_give_one_line_and_exit_2(tmp_path, base, capsys, extra, match):
    data = write_jsonl(tmp_path / "d.jsonl", pair_records())
    argv = ["finetune", "--model", str(base), "--data", str(data), "--out", str(tmp_path / "r"), "--steps", "1",
            "--seq-len", "16", "--quiet", *extra]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    import re

    assert re.search(match, err), err


def test_empty_data_file_refused(tmp_path, base):
    (tmp_path / "e.jsonl").write_text("")
    ft = FinetuneConfig(model=str(base), data=str(tmp_path / "e.jsonl"))
    with pytest.raises(InputError, match=r"e\.jsonl' is empty"):
        prepare(ft, TrainConfig(task="finetune", steps=1, seq_len=16, warmup_steps=0), run_dir=None)


def test_resume_on_another_base_refused(tmp_path, base, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", pair_records())
    out = tmp_path / "run"
    argv = ["finetune", "--model", str(base), "--data", str(data), "--out", str(out), "--method", "full",
            "--steps", "2", "--seq-len", "16", "--quiet", "--json"]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    from oneblock.io.checkpoint import save
    from oneblock.models import build_model

    other = load(base).config.replace(n_layers=1)
    save(build_model(other), base)  # the same path now holds another model
    assert main(["finetune", "--resume", "--out", str(out), "--quiet"]) == 2
    assert "the run was trained on a base with identity" in capsys.readouterr().err
    assert main(["finetune", "--resume", "--out", str(out), "--steps", "3"]) == 2
    assert "drop --steps" in capsys.readouterr().err
    save(load(tmp_path / "run" / "model.safetensors"), base)  # a base of the right shape again
    data.write_text(data.read_text().replace("tac", "cat"))
    assert main(["finetune", "--resume", "--out", str(out), "--quiet"]) == 2
    assert "is not the data this run trained on" in capsys.readouterr().err


def test_lora_run_writes_a_peft_adapter_that_reloads_to_the_same_logits(tmp_path, base, capsys):
    from oneblock.adapters.peft import load_adapter
    from oneblock.errors import ConversionError

    data = write_jsonl(tmp_path / "d.jsonl", pair_records())
    out = tmp_path / "run"
    argv = ["finetune", "--model", str(base), "--data", str(data), "--out", str(out), "--steps", "5",
            "--lr", "1e-2", "--seq-len", "16", "--rank", "4", "--quiet", "--json"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert sorted(p.name for p in out.iterdir() if p.suffix in (".json", ".safetensors")) == [
        "adapter_config.json", "adapter_model.safetensors", "config.json", "summary.json"
    ]  # fmt: skip
    ft, cfg, _ = read_run(out)
    trained = prepare(ft, cfg, run_dir=out, device="cpu")  # the run's model, with the final checkpoint
    trained.trainer.train(resume=True)  # nothing left to do: restores step 5
    fresh = load(base)
    load_adapter(fresh, out)
    tokens = torch.tensor([list(b"cat>tac.")])
    torch.testing.assert_close(fresh.eval()(tokens), trained.trainer.model.eval()(tokens), atol=1e-6, rtol=0)
    assert summary["trainable_parameters"] == sum(p.numel() for n, p in fresh.named_parameters() if "lora_" in n)
    from oneblock.models import build_model

    wider = build_model(load(base).config.replace(d_model=60))
    with pytest.raises(ConversionError, match=r"base"):  # both identities named
        load_adapter(wider, out)


def test_bad_data_gives_one_line_naming_file_and_line(tmp_path, base, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n{broken\n")
    argv = ["finetune", "--model", str(base), "--data", str(data), "--out", str(tmp_path / "r"), "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "d.jsonl:2: the record is not JSON" in err
    assert not (tmp_path / "r" / "checkpoints").exists()  # refused before anything was written
