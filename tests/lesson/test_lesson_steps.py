"""Every figure of the lesson, as ``oneblock.lesson`` computes it, against the values the lesson quotes and
against independent references (``F.gelu``, ``F.layer_norm``, binomial sums)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from oneblock.errors import InputError
from oneblock.lesson import STEPS, run_lesson


@pytest.fixture(scope="module")
def lesson():
    return run_lesson(seed=0)


def test_every_step_in_order_and_json_ready(lesson):
    assert list(lesson) == list(STEPS)
    assert all(step["title"] for step in lesson.values())
    assert json.loads(json.dumps(lesson)) == lesson  # plain Python values only


def test_gelu(lesson):
    rows = {r["x"]: r for r in lesson["gelu"]["rows"]}
    assert rows[1.0]["gelu"] == pytest.approx(0.8413, abs=5e-5)
    assert rows[-1.0]["gelu"] == pytest.approx(-0.1587, abs=5e-5)
    assert rows[0.0]["gelu"] == 0.0 and rows[-1.0]["relu"] == 0.0 and rows[1.0]["relu"] == 1.0
    x = torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64)
    assert [r["gelu_tanh"] for r in rows.values()] == pytest.approx(F.gelu(x, approximate="tanh").tolist(), abs=1e-12)
    assert rows[-1.0]["gelu_slope"] < 0.0 and rows[-1.0]["relu_slope"] == 0.0  # negatives still carry gradient
    assert rows[1.0]["phi"] == pytest.approx(0.5 * (1 + math.erf(1 / math.sqrt(2))), abs=1e-12)


def test_feedforward(lesson):
    f = lesson["feedforward"]
    assert (f["d_model"], f["d_ff"], f["expansion"]) == (64, 256, 4)
    assert f["parameters"] == {"w1": 64 * 256 + 256, "w2": 256 * 64 + 64, "total": 33_088}
    assert [s["output"][-1] for s in f["shapes"]] == [64, 256, 256, 64]
    assert f["ffn_max_change_elsewhere"] == 0.0 and f["ffn_max_change_at_changed"] > 0.0 and f["position_wise"]
    assert f["attention_max_change_elsewhere"] > 0.0


def test_residual(lesson):
    r = lesson["residual"]
    assert r["gradient_without_skips"] == pytest.approx(0.5**12, rel=1e-12)
    assert f"{r['gradient_without_skips']:.6f}" == "0.000244"
    assert r["gradient_with_skips"] == pytest.approx(1.5**12, rel=1e-12)
    assert r["sum_of_paths"] == pytest.approx(r["gradient_with_skips"], rel=1e-12)
    assert r["identity_path"] == 1.0 and r["n_paths"] == 4096
    assert r["dead_sublayers_with_skips"] == 1.0 and r["dead_sublayers_without_skips"] == 0.0


def test_layernorm(lesson):
    n = lesson["layernorm"]
    assert (n["mean"], n["variance"]) == (5.0, 5.0)
    assert n["deviations"] == [-3.0, -1.0, 1.0, 3.0]
    assert [round(v, 3) for v in n["normalized"]] == [-1.342, -0.447, 0.447, 1.342]
    assert [round(v, 3) for v in n["scaled"]] == [-1.683, 0.106, 1.894, 3.683]
    x = torch.tensor([2.0, 4.0, 6.0, 8.0])
    assert n["normalized"] == pytest.approx(F.layer_norm(x, (4,), eps=n["eps"]).tolist(), abs=1e-6)
    assert n["rms"] == pytest.approx(math.sqrt(30.0), rel=1e-6)
    assert n["rmsnorm"] == pytest.approx((x / math.sqrt(30.0 + n["eps"])).tolist(), abs=1e-6)
    assert n["normalized_mean"] == pytest.approx(0.0, abs=1e-6) and n["rmsnorm_mean"] > 0.5


def test_assembly(lesson):
    a = lesson["assembly"]
    for position in ("pre", "post"):
        assert a["placements"][position]["matches_block"] and a["placements"][position]["max_difference"] == 0.0
    assert a["placements"]["pre"]["formulas"][0] == "x = x + Attn(LN(x))"
    assert a["placements"]["post"]["formulas"][0] == "x = LN(x + Attn(x))"
    assert a["placements"]["pre"]["relative_change"] < 0.1  # a fresh pre-LN block starts near the identity
    trace = {r["module"]: r for r in a["trace"]}
    assert trace["block"]["input"] == trace["block"]["output"] == [[2, 5, 64]]  # (B, T, C)
    assert trace["ffn.w1"]["output"] == [[2, 5, 256]]  # (B, T, 4C)
    assert trace["ffn.w2"]["output"] == [[2, 5, 64]] and a["widest"] == 256


def test_parameters(lesson):
    p = lesson["parameters"]
    expected = {
        "attention": 16_640, "feedforward": 33_088, "norms": 256, "block": 49_984, "rule_of_thumb": 49_152,
        "blocks": 99_968, "token_embedding": 64_000, "position_embedding": 8_192, "final_norm": 128,
        "lm_head": 0, "total": 172_288,
    }  # fmt: skip
    for key, value in expected.items():
        assert p[key]["analytic"] == value, key
        if key != "rule_of_thumb":
            assert p[key]["measured"] == value, key
    assert p["head_is_token_embedding"] is True
    assert p["ffn_share_of_block"] == pytest.approx(2 / 3, abs=0.01)


def test_architectures(lesson):
    a = lesson["architectures"]
    families = {f["arch"]: f for f in a["families"]}
    assert families["encoder"]["sublayers_per_block"] == [2] and not families["encoder"]["future_weights_zero"]
    assert families["decoder"]["sublayers_per_block"] == [2] and families["decoder"]["future_weights_zero"]
    assert families["encoder-decoder"]["sublayers_per_block"] == [2, 3]
    assert families["decoder"]["parameters"] == families["decoder"]["measured"] == 172_288
    for f in families.values():
        assert f["parameters"] == f["measured"]
    c = a["causal_softmax"]
    assert c["scores"][1] == [1.0, 2.0]
    assert c["last_row_exp"] == pytest.approx([2.718, 7.389], abs=1e-3)
    assert c["last_row_exp_sum"] == pytest.approx(10.107, abs=1e-3)
    assert c["weights"][0] == [1.0, 0.0]  # the first token sees only itself
    assert c["weights"][1] == pytest.approx([0.269, 0.731], abs=1e-3)
    assert c["leaks"] and c["row_sums_masked_after"][0] < 1.0
    x = a["cross_attention"]
    assert x["shape"] == [1, 4, 3, 5] and len(x["map"]) == 3 and all(len(row) == 5 for row in x["map"])
    assert x["row_sums"] == pytest.approx([1.0, 1.0, 1.0], abs=1e-6)
    assert x["weight_above_diagonal"] > 0.0  # no causal mask on cross-attention


def test_tiny(lesson):
    t = lesson["tiny"]
    assert [s["shape"] for s in t["shapes"]] == [[2, 4], [2, 4, 8], [2, 4, 8], [2, 4, 8], [2, 4, 10]]
    assert t["attention_shape"] == [2, 2, 4, 4]
    assert t["config"]["d_head"] == 4 and t["all_passed"]
    assert {"causality", "rows sum to one", "future weights exactly zero"} <= {c["name"] for c in t["checks"]}


def test_seed_and_global_state():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    first = run_lesson(seed=5, steps=["tiny", "feedforward"])
    assert torch.equal(torch.rand(1), before)  # the lesson leaves the global generator alone
    assert run_lesson(seed=5, steps=["feedforward", "tiny"]) == first
    assert run_lesson(seed=6, steps=["tiny"])["tiny"]["tokens"] != first["tiny"]["tokens"]


def test_unknown_step():
    with pytest.raises(InputError, match=r"unknown lesson step\(s\) \['ffn'\]"):
        run_lesson(steps=["ffn"])


def test_family_table_names_presets_that_exist():
    from oneblock.lesson.families import USES
    from oneblock.presets import PRESETS

    named = [part.split(": ")[1] for example, _ in USES.values() for part in example.split("; ")]
    assert named == ["bert-base", "gpt2", "t5-small", "bart-base"]
    assert all(name in PRESETS for name in named)
