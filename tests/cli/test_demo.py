"""``oneblock demo``: the lesson's figures through the command line, as JSON and as tables."""

from __future__ import annotations

import json

import pytest

from oneblock.cli.main import main
from oneblock.lesson import STEPS, run_lesson


@pytest.fixture(scope="module")
def demo_json():
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(["demo", "--json"]) == 0
    return json.loads(buffer.getvalue())


def test_json_is_the_lesson(demo_json):
    assert demo_json["seed"] == 0
    assert list(demo_json)[1:] == list(STEPS)
    assert {k: v for k, v in demo_json.items() if k != "seed"} == json.loads(json.dumps(run_lesson(seed=0)))


def test_json_headline_figures(demo_json):
    gelu = {r["x"]: r for r in demo_json["gelu"]["rows"]}
    assert gelu[1.0]["gelu"] == pytest.approx(0.8413, abs=1e-4) and gelu[-1.0]["gelu"] == pytest.approx(
        -0.1587, abs=1e-4
    )
    assert demo_json["feedforward"]["ffn_max_change_elsewhere"] == 0.0
    assert demo_json["residual"]["gradient_without_skips"] == pytest.approx(0.000244, abs=1e-6)
    assert demo_json["layernorm"]["scaled"] == pytest.approx([-1.683, 0.106, 1.894, 3.683], abs=1e-3)
    p = demo_json["parameters"]
    assert [p[k]["measured"] for k in ("attention", "feedforward", "norms", "block", "blocks", "total")] == [
        16_640, 33_088, 256, 49_984, 99_968, 172_288
    ]  # fmt: skip
    assert demo_json["architectures"]["causal_softmax"]["weights"][1] == pytest.approx([0.269, 0.731], abs=1e-3)
    assert demo_json["tiny"]["attention_shape"] == [2, 2, 4, 4] and demo_json["tiny"]["all_passed"] is True


def test_seed_makes_it_reproducible(capsys):
    outputs = []
    for seed in ("3", "3", "4"):
        assert main(["demo", "--json", "--seed", seed, "--step", "tiny", "--step", "feedforward"]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0] == outputs[1]
    assert outputs[0]["tiny"]["tokens"] != outputs[2]["tiny"]["tokens"]
    assert list(outputs[0]) == ["seed", "feedforward", "tiny"]  # the lesson's order, whatever the flag order


def test_tables(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    headings = [f"{i}. " for i in range(1, 9)]
    positions = [out.index(h) for h in headings]
    assert positions == sorted(positions)  # eight steps, in order
    for text in (
        "0.8413", "-0.1587",  # GELU
        "(1, 6, 256)",  # FFN inside
        "2.441e-04", "129.7463",  # residuals
        "[-1.342, -0.447, 0.447, 1.342]", "[-1.683, 0.106, 1.894, 3.683]",  # LayerNorm
        "x = x + Attn(LN(x))", "x = LN(x + Attn(x))", "(2, 5, 256)",  # block
        "16,640", "33,088", "49,984", "49,152", "99,968", "64,000", "8,192", "172,288",  # parameters
        "[0.269, 0.731]", "src 5", "tgt 3",  # architectures
        "(2, 4, 10)", "(2, 2, 4, 4)", "causality",  # tiny
    ):  # fmt: skip
        assert text in out, text
    assert "✗" not in out


def test_unknown_step(capsys):
    assert main(["demo", "--step", "attention"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown lesson step(s) ['attention']" in err
