"""``oneblock demo``: the lesson's figures through the command line, as JSON and as tables."""

from __future__ import annotations

import json
import math

import pytest
import torch

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


def _gelu_exact(x: float) -> float:
    return x * 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _gelu_tanh(x: float) -> float:
    return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def test_json_gelu_and_feedforward(demo_json):
    rows = demo_json["gelu"]["rows"]
    assert [r["x"] for r in rows] == [-1.0, 0.0, 1.0]
    for r in rows:  # against math.erf and the tanh formula, not against oneblock
        assert r["gelu"] == pytest.approx(_gelu_exact(r["x"]), abs=1e-12)
        assert r["gelu_tanh"] == pytest.approx(_gelu_tanh(r["x"]), abs=1e-12)
        assert r["relu"] == max(r["x"], 0.0)
    assert [round(r["gelu"], 2) for r in rows] == [-0.16, 0.0, 0.84]
    assert rows[0]["gelu_slope"] < 0 and rows[0]["relu_slope"] == 0.0  # small negatives keep some gradient
    ffn = demo_json["feedforward"]
    assert (ffn["d_model"], ffn["d_ff"], ffn["expansion"]) == (64, 256, 4)
    shapes = {r["module"]: (r["input"][-1], r["output"][-1]) for r in ffn["shapes"]}
    assert shapes == {"ffn": (64, 64), "w1": (64, 256), "act": (256, 256), "w2": (256, 64)}
    assert ffn["parameters"] == {"w1": 64 * 256 + 256, "w2": 256 * 64 + 64, "total": 33_088}
    assert ffn["position_wise"] is True and ffn["ffn_max_change_at_changed"] > 0
    assert ffn["attention_max_change_elsewhere"] > 0  # attention, unlike the FFN, mixes positions


def test_json_residual_and_layernorm(demo_json):
    res = demo_json["residual"]
    assert (res["n_layers"], res["scale"]) == (12, 0.5)
    assert res["gradient_without_skips"] == 0.5**12 and round(res["gradient_without_skips"], 6) == 0.000244
    assert res["gradient_with_skips"] == pytest.approx(1.5**12) == res["sum_of_paths"]
    assert res["identity_path"] == 1.0 and res["dead_sublayers_with_skips"] == 1.0
    assert res["dead_sublayers_without_skips"] == 0.0
    ln = demo_json["layernorm"]
    assert ln["x"] == [2.0, 4.0, 6.0, 8.0] and (ln["mean"], ln["variance"]) == (5.0, 5.0)
    assert ln["deviations"] == [-3.0, -1.0, 1.0, 3.0] and ln["std"] == pytest.approx(2.236, abs=1e-3)
    x = torch.tensor([[2.0, 4.0, 6.0, 8.0]])
    reference = torch.nn.functional.layer_norm(x, (4,), eps=ln["eps"])[0]
    assert ln["normalized"] == pytest.approx(reference.tolist(), abs=1e-6)
    assert ln["normalized"] == pytest.approx([-1.342, -0.447, 0.447, 1.342], abs=1e-3)
    assert ln["scaled"] == pytest.approx((2 * reference + 1).tolist(), abs=1e-6)
    assert (ln["gamma"], ln["beta"]) == (2.0, 1.0)
    rms = torch.nn.RMSNorm(4, eps=ln["eps"])(x)[0]
    assert ln["rmsnorm"] == pytest.approx(rms.tolist(), abs=1e-6) and ln["rmsnorm_mean"] > 0.5  # mean kept


def test_json_assembly(demo_json):
    a = demo_json["assembly"]
    for position in ("post", "pre"):
        assert a["placements"][position]["matches_block"] is True
    assert a["placements"]["pre"]["formulas"][:2] == ["x = x + Attn(LN(x))", "x = x + FFN(LN(x))"]
    assert a["placements"]["post"]["formulas"] == ["x = LN(x + Attn(x))", "x = LN(x + FFN(x))"]
    rows = {r["module"]: r for r in a["trace"]}
    b, t, c = a["input_shape"]
    assert rows["block"]["input"] == rows["block"]["output"] == [[b, t, c]]
    assert rows["ffn.w1"]["output"] == [[b, t, 4 * c]] and rows["ffn.w2"]["output"] == [[b, t, c]]
    assert [r["module"] for r in a["trace"]][:3] == ["block", "attn_norm", "attn"]  # pre-LN: norm first
    assert a["widest"] == 4 * c


def test_json_parameters(demo_json):
    p = demo_json["parameters"]
    expected = {
        "attention": 16_640, "feedforward": 33_088, "norms": 256, "block": 49_984, "blocks": 99_968,
        "token_embedding": 64_000, "position_embedding": 8_192, "final_norm": 128, "lm_head": 0, "total": 172_288,
    }  # fmt: skip
    for key, value in expected.items():
        assert p[key]["analytic"] == p[key]["measured"] == value, key
    assert p["rule_of_thumb"] == {"analytic": 49_152, "measured": None, "formula": "12 x 64^2"}
    assert p["head_is_token_embedding"] is True and "tied" in p["lm_head"]["formula"]
    assert p["ffn_share_of_block"] == pytest.approx(33_088 / 49_984)


def test_json_architectures(demo_json):
    arch = demo_json["architectures"]
    families = {f["arch"]: f for f in arch["families"]}
    assert families["encoder"]["mask"] == "none (bidirectional)" and families["decoder"]["mask"] == "causal"
    assert "decoder: causal + cross" in families["encoder-decoder"]["mask"]
    assert [families[a]["sublayers_per_block"] for a in ("encoder", "decoder", "encoder-decoder")] == [
        [2], [2], [2, 3]
    ]  # fmt: skip
    for f in families.values():
        assert f["parameters"] == f["measured"] > 0
    assert families["decoder"]["future_weights_zero"] and not families["encoder"]["future_weights_zero"]
    c = arch["causal_softmax"]
    assert c["scores"][1] == [1.0, 2.0]
    assert c["last_row_exp"] == pytest.approx([math.e, math.e**2]) and round(c["last_row_exp_sum"], 3) == 10.107
    assert c["weights"][0] == [1.0, 0.0]  # the first token sees only itself
    assert c["weights"][1] == pytest.approx([1 / (1 + math.e), math.e / (1 + math.e)])
    assert [round(w, 3) for w in c["weights"][1]] == [0.269, 0.731]
    assert c["leaks"] is True and c["row_sums_masked_after"][0] < 1.0
    x = arch["cross_attention"]
    assert x["shape"][-2:] == [3, 5] and len(x["map"]) == 3 and all(len(row) == 5 for row in x["map"])
    assert x["row_sums"] == pytest.approx([1.0] * 3) and x["weight_above_diagonal"] > 0  # no causal mask


def test_json_tiny_forward(demo_json):
    tiny = demo_json["tiny"]
    assert tiny["config"] == {"vocab_size": 10, "d_model": 8, "n_heads": 2, "d_head": 4, "n_layers": 1}
    assert [s["shape"] for s in tiny["shapes"]] == [[2, 4], [2, 4, 8], [2, 4, 8], [2, 4, 8], [2, 4, 10]]
    assert tiny["attention_shape"] == [2, 2, 4, 4]
    names = {c["name"]: c["passed"] for c in tiny["checks"]}
    assert names == dict.fromkeys(
        ["attention shape", "rows sum to one", "future weights exactly zero", "causality",
         "batch row equals run alone", "feed-forward is position-wise"], True
    )  # fmt: skip


def test_failed_sanity_check_fails_the_demo(monkeypatch, capsys):
    import oneblock.lesson.tiny
    from oneblock.analysis.checks import CheckResult

    monkeypatch.setattr(
        oneblock.lesson.tiny, "run_checks", lambda model, seed=0: [CheckResult("causality", False, "leaked", {})]
    )
    assert main(["demo", "--step", "tiny"]) == 1
    assert "✗" in capsys.readouterr().out
