"""The experiments' measurements and verdict logic on small inputs (the full runs live in the CLI tests and docs)."""

from __future__ import annotations

import math

import torch

from oneblock.config import ModelConfig
from oneblock.models.ablations import BlockStack
from oneblock.train.experiments import norm_placement as npl
from oneblock.train.experiments import residuals


def test_no_skip_block_drops_only_the_residual():
    cfg = ModelConfig(arch="encoder", d_model=8, n_heads=2, n_layers=1, max_seq_len=4)
    torch.manual_seed(0)
    with_skip = BlockStack(cfg, skip=True)
    without = BlockStack(cfg, skip=False)
    without.load_state_dict(with_skip.state_dict())
    x = torch.randn(2, 4, 8)
    block = with_skip.blocks[0]
    h = block.attn_norm(x)
    h = block.attn(h, is_causal=False)
    expected = block.ffn(block.ffn_norm(h))  # f(norm(.)) twice, nothing added back
    torch.testing.assert_close(without(x), expected)
    assert not torch.allclose(with_skip(x), without(x))


def test_skips_keep_the_input_gradient_and_their_absence_shrinks_it():
    skip_w, skip_x = residuals.measure(6, skip=True, d_model=16, n_heads=2, seq_len=4, batch=2, seeds=1)
    none_w, none_x = residuals.measure(6, skip=False, d_model=16, n_heads=2, seq_len=4, batch=2, seeds=1)
    assert all(math.isfinite(v) and v > 0 for v in (skip_w, skip_x, none_w, none_x))
    assert 0.5 < skip_x < 2.0  # the identity path carries the gradient back about unchanged
    assert none_x < 0.1 * skip_x


def test_residual_report_lines_and_table():
    results = [residuals.DepthResult(d, 2.0, 4.0 * 0.5 ** (d - 1), 1.0, 0.5**d, 3.0, 0.01) for d in (1, 2, 12, 24)]
    lines = residuals.findings(results)
    assert lines[0].startswith("12 layers vs 1: first-layer gradient x1 with skips, x0.000488 without")
    assert lines[-2].startswith("without skips the first-layer gradient first falls below 1/10 of its 1-layer value")
    assert "at 12 layers; from there to 24 layers it shrinks by x0.50 per layer" in lines[-2]
    assert lines[-1].startswith("without skips and with norm epsilon 1e-12 instead of 1e-5, the first-layer gradient")
    table = residuals.markdown_table(results).splitlines()
    assert len(table) == 2 + len(results) and table[4].startswith("| 12 |")


def _run(depth, norm, lr, warmup, final, status="ok"):
    return npl.Run(depth, norm, lr, warmup, losses=[5.5] + [final] * 9, status=status)


def test_verdicts_flag_divergence_and_untestable_warmup():
    nan = npl.Run(2, "post", 1.0, False, losses=[5.5, math.nan])
    npl.judge(nan, unigram=3.0)
    assert nan.status == "diverged" and nan.final == math.inf
    rising = _run(2, "post", 1.0, False, 6.0)
    npl.judge(rising, unigram=3.0)
    assert rising.status == "diverged"
    flat = _run(2, "post", 1.0, False, 3.01)
    npl.judge(flat, unigram=3.0)
    assert flat.status == "stalled"
    setup = npl.Setup(depths=(2,), lrs=(1.0,))
    runs = [_run(2, "pre", 1.0, False, 2.5), _run(2, "pre", 1.0, True, 2.4), nan, _run(2, "post", 1.0, True, 2.6)]
    grads = {"pre-2": [1.0, 0.8], "post-2": [1.0, 1.5]}
    lines = npl.claims(runs, grads, setup)
    assert lines[0].endswith("post-LN grows toward the output: HELD")
    assert lines[1].endswith("pre-LN trains more stably: HELD")  # post-LN diverged without warmup
    assert lines[2].endswith("pre-LN trains more stably: HELD")  # 2.4 vs 2.6
    assert "pre-LN needs less warmup: HELD" in lines[3]
    runs[3] = _run(2, "post", 1.0, True, 3.1, status="stalled")
    assert "INCONCLUSIVE (post-LN failed with and without warmup)" in npl.claims(runs, grads, setup)[3]
    runs[2:] = [_run(2, "post", 1.0, False, 2.51), _run(2, "post", 1.0, True, 2.39)]
    lines = npl.claims(runs, grads, setup)
    assert lines[1].endswith("TIE (within 0.02)") and lines[3].endswith("TIE (within 0.02)")
    runs[2] = _run(2, "post", 1.0, False, 2.3)
    assert npl.claims(runs, grads, setup)[1].endswith("pre-LN trains more stably: NOT HELD")


def test_layer_gradient_norms_one_per_block():
    setup = npl.Setup(depths=(3,), d_model=8, n_heads=2, seq_len=8, batch_size=2)
    for norm in ("pre", "post"):
        grads = npl.layer_gradient_norms(setup, 3, norm)
        assert len(grads) == 3 and all(math.isfinite(g) and g > 0 for g in grads)
