"""``oneblock experiment``: the quick runs write their PNG and report, and every figure is finite."""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys

import pytest
import torch

from oneblock.cli import experiment
from oneblock.cli.main import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _restore_threads():
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


def _numbers(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)
    elif isinstance(value, float):
        yield value


def _check_files(report, tmp_path, name):
    assert report["png"] == str(tmp_path / f"{name}.png") and report["markdown"] == str(tmp_path / f"{name}.md")
    png = (tmp_path / f"{name}.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 20_000


@pytest.fixture(scope="module")
def norm_placement(tmp_path_factory):
    """One quick norm-placement run shared by the tests below (it is the slowest command here)."""
    out = tmp_path_factory.mktemp("norm")
    previous = torch.get_num_threads()
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            code = main(["experiment", "norm-placement", "--quick", "--quiet", "--json", "--out", str(out)])
    finally:
        torch.set_num_threads(previous)
    assert code == 0
    return json.loads(buffer.getvalue()), out


def test_residuals_quick(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["experiment", "residuals", "--quick", "--quiet", "--json", "--out", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    _check_files(report, tmp_path, "residuals")
    assert [r["depth"] for r in report["results"]] == [1, 2, 4, 8, 12, 24]
    assert all(math.isfinite(x) and x > 0 for x in _numbers(report["results"]))
    with_skips = [r["input_skip"] for r in report["results"]]
    assert max(with_skips) / min(with_skips) < 1.5  # the identity path: same input gradient at every depth
    assert report["results"][-1]["input_no_skip"] < 0.01 * report["results"][-1]["input_skip"]
    text = (tmp_path / "residuals.md").read_text()
    assert "| 12 |" in text and "0.5-per-layer" in text


def test_residuals_table_output(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["experiment", "residuals", "--quick", "--quiet", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Gradient norms at initialization" in out and f"wrote {tmp_path / 'residuals.png'}" in out


def test_norm_placement_quick(norm_placement):
    pytest.importorskip("matplotlib")
    report, out = norm_placement
    _check_files(report, out, "norm_placement")
    assert set(report["grads"]) == {"pre-2", "post-2", "pre-6", "post-6"}
    assert len(report["grads"]["post-6"]) == 6
    assert all(math.isfinite(x) and x > 0 for x in _numbers(report["grads"]))
    assert len(report["runs"]) == 2 * 2 * 2 * 2  # depths x learning rates x warmup x placement
    for run in report["runs"]:
        assert run["status"] in ("ok", "stalled", "diverged")
        assert run["status"] == "diverged" or all(math.isfinite(x) for x in run["losses"])
    assert len(report["claims"]) == 2 + 2 * 2 * 3  # gradients per depth; per (depth, lr): two stability, one warmup
    verdicts = {line.split(": ")[-1].split(" ")[0] for line in report["claims"]}
    assert verdicts <= {"HELD", "NOT", "INCONCLUSIVE", "TIE"}
    text = (out / "norm_placement.md").read_text()
    assert "| depth | lr | warmup |" in text and "smoke test" in text


def test_norm_placement_table_output(norm_placement, capsys):
    report, _ = norm_placement
    experiment._show("norm-placement", report)
    out = capsys.readouterr().out
    assert "Final training loss" in out and "pre-LN trains more stably" in out


def test_missing_matplotlib_and_bad_names_are_one_line(tmp_path, capsys, monkeypatch):
    assert main(["experiment", "attention-sinks"]) == 2
    assert "invalid choice: 'attention-sinks'" in capsys.readouterr().err
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["experiment", "residuals", "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'oneblock[plot]'" in err
    assert not list(tmp_path.iterdir())  # failed before any work


def test_warmup_quick(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["experiment", "warmup", "--quick", "--quiet", "--json", "--out", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    _check_files(report, tmp_path, "warmup")
    setup = report["setup"]
    n_cells = len(setup["depths"]) * len(setup["lrs"]) * 4
    assert len(report["cells"]) == n_cells and len(report["runs"]) == n_cells * len(setup["seeds"])
    for cell in report["cells"]:
        losses = cell["losses"]
        assert len(losses) == len(setup["seeds"]) and all(math.isfinite(x) and x > 0 for x in losses)
        assert math.isclose(cell["mean"], sum(losses) / len(losses), rel_tol=1e-12)
    assert report["verdict"]["outcome"] in ("SUPPORTED", "NOT SUPPORTED", "INCONCLUSIVE")
    assert len(report["verdict"]["lines"]) == len(setup["depths"]) * len(setup["lrs"])
    text = (tmp_path / "warmup.md").read_text()
    assert f"**Verdict: {report['verdict']['outcome']}**" in text and "| depth | placement |" in text
    experiment._show("warmup", report)
    assert "verdict:" in capsys.readouterr().out
