"""``oneblock experiment finetune``: the task's generator, exact match, the verdict's rule, and a quick run whose
table counts what the rows really train."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from oneblock.finetune import experiment
from oneblock.finetune.experiment import exact_match, verdict
from oneblock.finetune.task_data import PHRASINGS, Order, orders, preference_pairs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_generator_is_deterministic_and_its_split_shares_no_prompt():
    train, held = orders(240, 32, seed=0)
    assert (train, held) == orders(240, 32, seed=0) and orders(240, 32, seed=1) != (train, held)
    prompts = {o.prompt for o in train}
    assert len(prompts) == 240 and not prompts & {o.prompt for o in held}
    assert not {(o.item, o.origin, o.destination) for o in train} & {(o.item, o.origin, o.destination) for o in held}
    assert {o.phrasing for o in held} == set(range(len(PHRASINGS)))
    with pytest.raises(ValueError, match="n_train=0"):
        orders(0, 3)


def test_label_follows_the_route_whatever_the_phrasing():
    forms = [Order("lamps", 7, "Oslo", "Lima", k) for k in range(3)]
    assert [o.prompt for o in forms] == ["Ship 7 lamps from Oslo to Lima.", "Send 7 lamps to Lima from Oslo.",
                                         "From Oslo, deliver 7 lamps to Lima."]  # fmt: skip
    assert {o.label for o in forms} == {"SHIP:Oslo>Lima:lamps:7"}
    assert preference_pairs(forms[:1]) == [{"prompt": "Ship 7 lamps from Oslo to Lima.",
                                            "chosen": "SHIP:Oslo>Lima:lamps:7",
                                            "rejected": "7 lamps will be shipped from Oslo to Lima."}]  # fmt: skip


def test_exact_match_on_a_hand_made_case():
    answers = ["SHIP:Oslo>Lima:lamps:7", "SHIP:Dakar>Quito:kettles:12", "SHIP:Perth>Cairo:drums:3", "x"]
    predictions = [" SHIP:Oslo>Lima:lamps:7\n", "SHIP:Quito>Dakar:kettles:12", "SHIP:Perth>Cairo:drums:3.", "x"]
    assert exact_match(predictions, answers) == 0.5  # whitespace is stripped; order and punctuation count
    assert exact_match([], []) == 0.0
    with pytest.raises(ValueError, match="one prediction per answer; got 1 and 2"):
        exact_match(["a"], ["a", "b"])


def _result(name, trainable, em):
    return {"row": {"name": name}, "trainable": trainable, "after": {"exact_match": em}}


def test_verdict_rule():
    full = _result("full", 134_515_008, 0.9)
    assert verdict([full, _result("lora-r8", 2_442_240, 0.81)])["outcome"] == "SUPPORTED"  # 90%, 1.82%
    assert verdict([full, _result("lora-r8", 2_442_240, 0.80)])["outcome"] == "NOT SUPPORTED"  # 89%
    assert verdict([full, _result("lora-r8", 2_700_000, 0.9)])["outcome"] == "NOT SUPPORTED"  # 2.007%
    assert verdict([_result("full", 10, 0.0), _result("lora-r8", 1, 0.0)])["outcome"] == "INCONCLUSIVE"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    from oneblock.cli.main import main

    out = tmp_path_factory.mktemp("finetune")
    (out / "adapter-lora-r8").mkdir()  # an earlier run's adapter, with a file this run does not write
    (out / "adapter-lora-r8" / "stray.safetensors").write_bytes(b"old")
    (out / "notes.txt").write_text("the user's own")
    previous = torch.get_num_threads()
    try:
        import contextlib
        import io

        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            assert main(["experiment", "finetune", "--quick", "--quiet", "--json", "--out", str(out), "--force"]) == 0
    finally:
        torch.set_num_threads(previous)
    return json.loads(buffer.getvalue()), out


def test_quick_run_counts_what_each_row_trains(quick):
    from oneblock.adapters.apply import apply_lora
    from oneblock.adapters.lora import LoraConfig

    report, out = quick
    rows = {r["row"]["name"]: r for r in report["rows"]}
    assert list(rows) == [row.name for row in experiment.ROWS]
    model, _ = experiment.tiny_model()
    assert rows["full"]["trainable"] == sum(p.numel() for p in model.parameters())
    cfg = model.config
    kv = cfg.n_kv_heads * cfg.d_head
    per_rank = cfg.n_layers * (2 * (cfg.d_model + cfg.d_model) + 2 * (cfg.d_model + kv) + 3 * (cfg.d_model + cfg.d_ff))
    for name, rank in (("lora-r2", 2), ("lora-r8", 8), ("lora-r32", 32), ("lora-r8-4bit", 8), ("dpo-r8", 8)):
        assert rows[name]["trainable"] == rank * per_rank, name
    adapted = apply_lora(model, LoraConfig(rank=8, alpha=16))
    assert rows["lora-r8"]["trainable"] == sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    for r in report["rows"]:
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["peak_rss_mb"] > 0
        assert 0 <= r["after"]["exact_match"] <= 1 and r["after"]["loss"] < r["before"]["loss"]
        assert len(r["after"]["answers"]) == report["setup"]["n_held_out"]
    before, after = rows["dpo-r8"]["before"]["preference"], rows["dpo-r8"]["after"]["preference"]
    assert before["reward_margin"] == 0.0 and after["loss"] < before["loss"]  # the policy starts as its reference
    assert (out / "adapter-lora-r8" / "adapter_config.json").is_file()
    assert (out / "finetune.png").read_bytes().startswith(PNG_MAGIC)
    text = (out / "finetune.md").read_text()
    assert "| lora-r8 | 14,848 | 19.00% |" in text and f"**Verdict: {report['verdict']['outcome']}**" in text


def test_force_replaces_the_earlier_runs_adapters_whole_and_keeps_other_files(quick):
    _, out = quick
    assert not (out / "adapter-lora-r8" / "stray.safetensors").exists()
    assert (out / "adapter-lora-r8" / "adapter_model.safetensors").is_file()
    assert (out / "notes.txt").read_text() == "the user's own"


def one_line_error(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("oneblock: error: "), err
    return err


def test_a_non_empty_or_file_out_is_refused_before_any_work(tmp_path, capsys):
    from oneblock.cli.main import main

    (tmp_path / "adapter-full").mkdir()
    (tmp_path / "finetune.md").write_text("earlier")
    code = main(["experiment", "finetune", "--quick", "--quiet", "--out", str(tmp_path)])
    line = one_line_error(capsys, code)
    assert re.search(r"--out '.*' is not empty \(2 entries: adapter-full, finetune\.md\); pass --force", line)
    assert (tmp_path / "finetune.md").read_text() == "earlier" and sorted(os.listdir(tmp_path)) == [
        "adapter-full",
        "finetune.md",
    ]
    code = main(["experiment", "finetune", "--quick", "--quiet", "--out", str(tmp_path / "finetune.md"), "--force"])
    assert re.search(
        r"--out '.*finetune\.md' is a file; the experiment writes a directory", one_line_error(capsys, code)
    )
    os.mkfifo(tmp_path / "pipe")
    code = main(["experiment", "residuals", "--quick", "--quiet", "--out", str(tmp_path / "pipe")])
    assert "is a FIFO (named pipe); the experiment writes a directory" in one_line_error(capsys, code)


def test_clear_products_removes_only_what_a_run_writes(tmp_path):
    (tmp_path / "adapter-dpo-r8").mkdir()
    (tmp_path / "adapter-dpo-r8" / "x").write_bytes(b"x")
    (tmp_path / "finetune.json").write_text("{}")
    (tmp_path / "adapter-mine").mkdir()
    (tmp_path / "finetune.png").symlink_to(tmp_path / "adapter-mine")  # a link goes, never what it points to
    removed = experiment.clear_products(tmp_path)
    assert sorted(p.name for p in removed) == ["adapter-dpo-r8", "finetune.json", "finetune.png"]
    assert sorted(os.listdir(tmp_path)) == ["adapter-mine"]
