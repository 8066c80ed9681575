"""``oneblock trace``: shapes from forward hooks, per block or for the whole model."""

from __future__ import annotations

import json

from oneblock.cli.main import main


def trace_json(capsys, *argv: str) -> dict:
    assert main(["trace", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def rows_by_name(data: dict) -> dict:
    return {r["module"]: r for r in data["rows"]}


def test_one_block_of_the_lesson(capsys):
    data = trace_json(capsys, "--block", "1", "--batch", "3", "--seq-len", "7")
    rows = rows_by_name(data)
    assert data["traced"] == "blocks.1"
    assert data["rows"][0]["module"] == "blocks.1" and data["rows"][0]["parameters"] == 49_984
    assert rows["blocks.1.ffn.w1"]["inputs"] == [[3, 7, 64]]
    assert rows["blocks.1.ffn.w1"]["outputs"] == [[3, 7, 256]]  # (B, T, 4C) inside the FFN
    assert rows["blocks.1.ffn.w2"]["outputs"] == [[3, 7, 64]]
    assert rows["blocks.1.attn"]["parameters"] == 16_640
    assert [r["module"] for r in data["rows"]][:3] == ["blocks.1", "blocks.1.attn_norm", "blocks.1.attn"]  # pre-LN


def test_whole_model_in_call_order(capsys):
    data = trace_json(capsys, "--preset", "tiny")
    names = [r["module"] for r in data["rows"]]
    assert names[0] == "model" and names[-1] == "lm_head"
    assert names.index("embed") < names.index("blocks.0") < names.index("final_norm") < names.index("lm_head")
    rows = rows_by_name(data)
    assert rows["model"]["inputs"] == [[2, 8]] and rows["model"]["outputs"] == [[2, 8, 10]]
    assert rows["embed"]["outputs"] == [[2, 8, 8]]
    assert rows["model"]["parameters"] == 1_096


def test_post_ln_order_and_depth(capsys):
    data = trace_json(capsys, "--norm-position", "post", "--block", "0", "--depth", "1")
    assert [r["module"] for r in data["rows"]] == [
        "blocks.0", "blocks.0.attn", "blocks.0.attn_norm", "blocks.0.ffn", "blocks.0.ffn_norm"
    ]  # fmt: skip


def test_encoder_decoder_cross_attention(capsys):
    data = trace_json(capsys, "--arch", "encoder-decoder", "--block", "0", "--seq-len", "3", "--src-len", "5")
    rows = rows_by_name(data)
    assert data["traced"] == "decoder.blocks.0"
    cross = rows["decoder.blocks.0.cross_attn"]
    assert cross["inputs"] == [[2, 3, 64], [2, 5, 64]]  # queries from the decoder, keys/values from the source
    assert rows["decoder.blocks.0.cross_attn.k_proj"]["outputs"] == [[2, 5, 64]]
    enc = trace_json(capsys, "--arch", "encoder-decoder", "--block", "0", "--stack", "encoder", "--seq-len", "3",
                     "--src-len", "5")  # fmt: skip
    assert enc["rows"][0]["module"] == "encoder.blocks.0" and enc["rows"][0]["inputs"] == [[2, 5, 64]]


def test_shared_embedding_named_after_its_caller(capsys):
    data = trace_json(capsys, "--arch", "encoder-decoder", "--n-layers", "1", "--depth", "2")
    names = [r["module"] for r in data["rows"]]
    assert "encoder.embed.tok" in names and "decoder.embed.tok" in names


def test_table_output(capsys):
    assert main(["trace", "--block", "0"]) == 0
    out = capsys.readouterr().out
    assert "blocks.0.ffn.w1" in out and "(2, 8, 256)" in out and "16,640" in out


def test_errors(capsys):
    for argv, text in [
        (["--block", "2"], "--block 2 is out of range: the model has blocks 0..1"),
        (["--seq-len", "129"], "--seq-len (129) exceeds max_seq_len (128); pass a shorter --seq-len"),
        (["--batch", "0"], "--batch must be a positive integer; got 0"),
        (["--stack", "encoder"], "--stack only applies to encoder-decoder models"),
        (["--src-len", "3"], "--src-len only applies to encoder-decoder models; this one is a decoder"),
        (["--depth", "-1"], "--depth must be 0 or more"),
    ]:
        assert main(["trace", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and text in err, err


def test_t5_small_trace_shows_the_bias_tables(capsys):
    data = trace_json(capsys, "--preset", "t5-small", "--batch", "2", "--seq-len", "5")
    rows = rows_by_name(data)
    assert rows["model"]["parameters"] == 60_506_624
    assert rows["encoder.relative_bias"]["outputs"] == [[1, 8, 5, 5]]  # (1, H, T, S), one table per stack
    assert rows["decoder.relative_bias"]["parameters"] == 32 * 8
    assert rows["decoder.blocks.0.ffn.w1"]["outputs"] == [[2, 5, 2048]]
    assert "encoder.embed.pos" not in rows
