"""``oneblock count``: published parameter counts, FLOPs, memory and --verify, all through the command line."""

from __future__ import annotations

import json

import pytest

import oneblock.analysis.counting
from oneblock.analysis.counting import count_flops, weight_memory
from oneblock.cli.main import main
from oneblock.presets import get_preset

PUBLISHED = {
    "lesson": 172_288,
    "tiny": 1_096,
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "bert-base": 109_482_240,
    "bart-base": 139_420_416,
    "minilm": 22_713_216,
    "smollm2-135m": 134_515_008,
    "t5-small": 60_506_624,  # as transformers counts T5ForConditionalGeneration
    "t5-v1_1-small": 76_961_152,
    "qwen2.5-0.5b": 494_032_768,  # these eleven equal transformers' numel: tests/test_presets.py
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen3-0.6b": 596_049_920,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "gemma-2-2b": 2_614_341_888,
    "gemma-3-1b": 999_885_952,
    "gemma-3-270m": 268_098_176,
    "granite-3.1-2b": 2_533_531_648,
    "smollm3-3b": 3_075_098_624,
    "olmo-2-1b": 1_484_916_736,
}


def count_json(capsys, *argv: str) -> dict:
    assert main(["count", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(("preset", "total"), PUBLISHED.items())
def test_preset_totals(preset, total, capsys):
    data = count_json(capsys, "--preset", preset)
    assert data["total"] == total
    assert sum(data["breakdown"].values()) == total
    cfg = get_preset(preset)
    assert data["flops_per_token"] == count_flops(cfg)
    assert data["memory_bytes"] == weight_memory(cfg) == {"fp32": 4 * total, "bf16": 2 * total}


def test_lesson_figures(capsys):
    data = count_json(capsys)
    assert (data["per_block"], data["rule_of_thumb"], data["attention"], data["feedforward"]) == (
        49_984, 49_152, 16_640, 33_088
    )  # fmt: skip
    assert data["norms_per_block"] == 256
    assert data["breakdown"] == {
        "token_embedding": 64_000,
        "position_embedding": 8_192,
        "attention": 2 * 16_640,
        "feedforward": 2 * 33_088,
        "block_norms": 512,
        "final_norm": 128,
    }
    assert data["non_embedding"] == 172_288 - 64_000 - 8_192
    # per token, a multiply-add is 2 FLOPs: 2 x the block matrices (biases included), 2 x V x C for the tied head,
    # and per layer 2 x T x C multiply-adds for the scores and as many for the weighted sum, at T = 128
    assert data["flops_per_token"] == {
        "matmul": 2 * 2 * (16_640 + 33_088),
        "head": 2 * 1_000 * 64,
        "attention": 2 * (2 * 2 * 128 * 64),
        "attention_causal": 2 * 2 * 128 * 64,
        "total": 198_912 + 128_000 + 65_536,
        "seq_len": 128,
    }
    assert data["memory_bytes"] == {"fp32": 689_152, "bf16": 344_576}


def test_seq_len_moves_only_the_attention_flops(capsys):
    short = count_json(capsys, "--seq-len", "16")["flops_per_token"]
    long = count_json(capsys, "--seq-len", "32")["flops_per_token"]
    assert short["matmul"] == long["matmul"] and short["head"] == long["head"]
    assert long["attention"] == 2 * short["attention"] and short["seq_len"] == 16
    assert short == count_flops(get_preset("lesson"), 16)


def test_flags_change_the_count(capsys):
    data = count_json(capsys, "--untied", "--no-bias")
    assert data["breakdown"]["lm_head"] == 64_000
    assert data["attention"] == 4 * 64 * 64 and data["feedforward"] == 2 * 64 * 256


@pytest.mark.parametrize(
    "preset", ["lesson", "gpt2", "bart-base", "smollm2-135m", "bert-base", "t5-small", "qwen2.5-0.5b", "qwen3-0.6b",
               "llama-3.2-1b"]
)  # fmt: skip
def test_verify_against_numel(preset, capsys):
    data = count_json(capsys, "--preset", preset, "--verify")
    assert data["measured"] == data["total"] == PUBLISHED[preset] and data["verified"] is True


def test_verify_exits_1_on_mismatch(monkeypatch, capsys):
    real = oneblock.analysis.counting.count_parameters

    def off_by_one(cfg):
        count = real(cfg)
        return type(count)(**{**count.__dict__, "total": count.total + 1})

    monkeypatch.setattr(oneblock.analysis.counting, "count_parameters", off_by_one)
    assert main(["count", "--verify", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["verified"] is False and data["measured"] == 172_288
    assert main(["count", "--verify"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_table_output(capsys):
    assert main(["count", "--preset", "gpt2"]) == 0
    out = capsys.readouterr().out
    for text in ("124,439,808", "7,087,872", "rule of thumb", "forward FLOPs / token", "497.8 MB", "248.9 MB"):
        assert text in out
    assert "{" not in out  # tables, not JSON


def test_later_decoder_presets_are_listed_and_counted(capsys):
    assert main(["count", "--help"]) == 0
    listed = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    for name in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen3-0.6b", "llama-3.2-1b", "llama-3.2-3b"):
        assert name in listed
    data = count_json(capsys, "--model", "qwen3-0.6b")
    assert data["model"] == "qwen3-0.6b" and data["config"]["qk_norm"] is True
    # per block: q (1024 x 2048), k and v (1024 x 1024 each), o (2048 x 1024), two head norms of 128; SwiGLU's
    # three 1024 x 3072 matrices; two RMSNorms of 1024
    assert data["per_block"] == 2 * 1024 * 2048 + 2 * 1024 * 1024 + 2 * 128 + 3 * 1024 * 3072 + 2 * 1024
    assert main(["count", "--preset", "llama-3.2-1b"]) == 0
    assert "1,235,814,400" in capsys.readouterr().out


def test_bad_seq_len(capsys):
    assert main(["count", "--seq-len", "0"]) == 2
    assert "--seq-len must be a positive integer; got 0" in capsys.readouterr().err


def test_encoder_decoder_labels_keep_their_stack(capsys):
    from oneblock.cli.count import label_of

    assert label_of("decoder.cross_attention") == "decoder cross-attention (+ its norm)"
    assert label_of("token_embedding") == "token embedding"
    assert main(["count", "--preset", "bart-base"]) == 0
    out = capsys.readouterr().out
    assert "139,420,416" in out and "decoder cross-attention (+ its norm)" in out and "one decoder block" in out


def test_t5_relative_bias_tables_are_counted_per_stack(capsys):
    data = count_json(capsys, "--preset", "t5-small")
    assert data["breakdown"]["encoder.relative_position_bias"] == 32 * 8
    assert data["breakdown"]["decoder.relative_position_bias"] == 32 * 8
    assert "encoder.position_embedding" not in data["breakdown"]


def test_diff_lists_how_the_block_differs_from_the_lessons(capsys):
    from oneblock.analysis.block_diff import block_differences

    data = count_json(capsys, "--model", "llama-3.2-1b", "--diff")
    assert data["block_diff"] == [row.as_dict() for row in block_differences(get_preset("llama-3.2-1b"))]
    by_key = {row["key"]: row for row in data["block_diff"]}
    assert by_key["n_kv_heads"]["label"] == "grouped-query attention (8 key/value heads of 32)"
    assert by_key["n_kv_heads"]["parameters"] == -16 * 2 * 2048 * (2048 - 512)
    assert by_key["ffn"]["parameters"] == 16 * 2048 * 8192
    assert "block_diff" not in count_json(capsys, "--model", "llama-3.2-1b")  # only when asked
    assert count_json(capsys, "--diff")["block_diff"] == []  # the lesson itself

    assert main(["count", "--model", "qwen2.5-0.5b", "--diff"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long labels
    assert "How the block differs from the lesson's" in out
    for text in ("RMSNorm instead of LayerNorm", "-43,904", "+104,595,456", "grouped-query attention", "-276,480"):
        assert text in out
    assert main(["count", "--diff"]) == 0
    assert "The block is the lesson's: no option differs." in capsys.readouterr().out


def test_diff_of_gemma_3_lists_its_options(capsys):
    data = count_json(capsys, "--preset", "gemma-3-1b", "--diff")
    by_key = {row["key"]: row for row in data["block_diff"]}
    assert list(by_key) == [
        "norm_position", "norm", "ffn", "activation", "position", "rope_local_theta", "n_kv_heads", "d_head", "bias",
        "qk_norm", "sliding_window", "attn_scale", "scale_embeddings",
    ]  # fmt: skip
    assert by_key["norm_position"]["parameters"] == 2 * 26 * 1152 and by_key["sliding_window"]["parameters"] == 0
    assert by_key["position"]["reverted"] == {"position": "learned", "rope_local_theta": None}
    assert main(["count", "--preset", "gemma-3-1b", "--diff"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long labels
    for text in ("sandwich norms", "+59,904", "sliding window 512", "22 of 26 layers", "base 10,000", "+13,312",
                 "multi-query attention", "a mask has no parameters", "a rotary base has no parameters"):  # fmt: skip
        assert text in out
    assert main(["count", "--preset", "gemma-2-2b", "--diff"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "tanh(s / 50) x 50" in out and "tanh(z / 30) x 30" in out and "13 of 26 layers" in out


def test_diff_marks_a_figure_the_lessons_rule_cannot_give(capsys):
    assert main(["count", "--model", "t5-v1_1-small", "--diff"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "512/6, not whole" in out and "n/a" in out and "+16,449,536" in out  # its untied head
