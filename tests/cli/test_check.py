"""``oneblock check``: the sanity checks through the command line, and exit 1 on a failure."""

from __future__ import annotations

import json

import pytest

import oneblock.analysis.checks
from oneblock.analysis.checks import CheckResult
from oneblock.cli.main import main


@pytest.mark.parametrize(
    ("argv", "arch", "names"),
    [
        ([], "decoder", {"causality", "future weights exactly zero", "feed-forward is position-wise"}),
        (["--arch", "encoder"], "encoder", {"rows sum to one", "batch row equals run alone"}),
        (["--arch", "encoder-decoder", "--norm-position", "post"], "encoder-decoder", {"causality"}),
        (["--preset", "tiny", "--position", "rope", "--ffn", "swiglu", "--norm", "rmsnorm"], "decoder", {"causality"}),
        (
            ["--preset", "t5-small"],
            "encoder-decoder",
            {
                "causality",
                "future weights exactly zero",
                "cross-attention is T x S, unmasked",
                "encoder is bidirectional",
            },
        ),
    ],
)
def test_checks_pass(argv, arch, names, capsys):
    assert main(["check", *argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["arch"] == arch and data["passed"] is True
    assert all(c["passed"] for c in data["checks"])
    assert names <= {c["name"] for c in data["checks"]}


def test_causality_figures(capsys):
    assert main(["check", "--json"]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["causality"]["figures"]["earlier_max_change"] == 0.0
    assert checks["causality"]["figures"]["last_max_change"] > 0.0
    assert checks["future weights exactly zero"]["figures"]["max_future_weight"] == 0.0


def test_failure_exits_1(monkeypatch, capsys):
    def failing(model, *, seed=0):
        return [CheckResult("causality", False, "earlier positions moved by 0.5", {"earlier_max_change": 0.5})]

    monkeypatch.setattr(oneblock.analysis.checks, "run_checks", failing)
    assert main(["check"]) == 1
    out = capsys.readouterr().out
    assert "causality" in out and "✗" in out and "1 of 2 passed" in out  # cached decoding runs beside them
    assert main(["check", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["passed"] is False


def test_table_output(capsys):
    assert main(["check", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "Sanity checks of tiny (decoder)" in out and "✓" in out and "✗" not in out


@pytest.fixture
def leaky_build(monkeypatch):
    """``build_model`` whose decoder blocks forget their causal mask: a real model that sees the future."""
    import oneblock.models

    real = oneblock.models.build_model

    def build(cfg, **kwargs):
        model = real(cfg, **kwargs)
        for module in model.modules():
            if hasattr(module, "causal"):
                module.causal = False
        return model

    monkeypatch.setattr(oneblock.models, "build_model", build)


def test_a_model_that_leaks_exits_1(leaky_build, capsys):
    assert main(["check", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    checks = {c["name"]: c for c in data["checks"]}
    assert data["passed"] is False
    assert checks["causality"]["passed"] is False and checks["causality"]["figures"]["earlier_max_change"] > 0
    assert checks["future weights exactly zero"]["figures"]["max_future_weight"] > 0
    assert checks["rows sum to one"]["passed"] is True  # the leak hides from the row sums
    assert main(["check"]) == 1
    assert "✗" in capsys.readouterr().out


def test_an_encoder_is_allowed_to_see_the_future(leaky_build, capsys):
    assert main(["check", "--arch", "encoder", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"] is True


@pytest.mark.parametrize("flag", ["--max-seq-len", "--vocab-size"])
def test_too_small_for_the_causality_check(flag, capsys):
    assert main(["check", "--preset", "tiny", flag, "1"]) == 2
    err = capsys.readouterr().err
    field = flag[2:].replace("-", "_")
    assert err.count("\n") == 1 and f"needs {field} >= 2; got {field} 1" in err


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder-decoder"])
def test_a_half_precision_checkpoint_is_checked_in_its_own_dtype(arch, dtype, tmp_path, capsys):
    import torch

    import oneblock as ob

    cfg = ob.ModelConfig(arch=arch, vocab_size=50, d_model=36, n_heads=3, d_ff=37, n_layers=2, max_seq_len=16)
    torch.manual_seed(0)
    path = ob.save(ob.build_model(cfg).to(getattr(torch, dtype)), tmp_path / "half.safetensors")
    assert main(["check", "--checkpoint", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] is True and all(c["passed"] for c in data["checks"])
    if arch == "decoder":  # exact properties stay exact in any dtype
        causality = next(c for c in data["checks"] if c["name"] == "causality")
        assert causality["figures"]["earlier_max_change"] == 0.0
