"""``oneblock demo``: the lesson as a program, every figure computed live by ``oneblock.lesson``.

This module only renders; the figures come from ``oneblock.lesson.run_lesson``.
"""

from __future__ import annotations

import argparse
from typing import Any

from oneblock.cli import options
from oneblock.cli.render import cell, console, heading, print_json, shape, table, vector


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "demo",
        help="walk through the lesson: every number computed live by oneblock",
        description=(
            "Walk through one transformer block in the lesson's order: GELU, the position-wise feed-forward "
            "network, residual connections, layer normalization, pre-LN against post-LN, the parameter count, "
            "the three architectures and a tiny forward pass with its sanity checks. Every figure is computed "
            "by oneblock as the command runs."
        ),
    )
    options.add_seed_option(parser)
    options.add_threads_option(parser)
    options.add_json_option(parser)
    parser.add_argument(
        "--step",
        action="append",
        metavar="NAME",
        help="show only this step (repeatable): gelu, feedforward, residual, layernorm, assembly, parameters, "
        "architectures, tiny",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    from oneblock.lesson import STEPS, run_lesson

    options.set_threads(args.threads)
    figures = run_lesson(seed=args.seed, steps=args.step)
    status = 0 if figures.get("tiny", {}).get("all_passed", True) else 1  # a failed sanity check fails the demo
    if args.json:
        print_json({"seed": args.seed, **figures})
        return status
    out = console()
    for name, step in figures.items():
        number = list(STEPS).index(name) + 1
        out.print()
        out.print(heading(f"{number}. {step['title']}"))
        for renderable in RENDERERS[name](step):
            out.print(renderable)
    return status


def _gelu(f: dict[str, Any]) -> list[Any]:
    rows = [
        (f"{r['x']:g}", r["phi"], r["gelu"], r["gelu_tanh"], r["relu"], r["gelu_slope"], r["relu_slope"])
        for r in f["rows"]
    ]
    columns = ["x", "Phi(x)", "GELU exact", "GELU tanh", "ReLU", "GELU slope", "ReLU slope"]
    return [table(None, columns, rows, caption="GELU = x Phi(x): smooth, and a small negative input keeps some slope.")]


def _feedforward(f: dict[str, Any]) -> list[Any]:
    shapes = table(
        f"FFN {f['d_model']} -> {f['d_ff']} -> {f['d_model']} ({f['expansion']}x expansion)",
        ["module", "kind", "input", "output"],
        [(r["module"], r["kind"], shape(r["input"]), shape(r["output"])) for r in f["shapes"]],
    )
    p = f["parameters"]
    params = table(
        "Parameters", ["matrix", "parameters"], [("W1 + b1", p["w1"]), ("W2 + b2", p["w2"]), ("total", p["total"])]
    )
    j, t = f["changed_position"], f["seq_len"]
    check = table(
        f"Live check: replace token {j} of {t}, rerun",
        ["what moved", "largest change", "as expected"],
        [
            (f"FFN output at position {j}", f["ffn_max_change_at_changed"], f["ffn_max_change_at_changed"] > 0),
            (f"FFN output at the other {t - 1} positions", f["ffn_max_change_elsewhere"], f["position_wise"]),
            (
                "attention output at the other positions",
                f["attention_max_change_elsewhere"],
                f["attention_max_change_elsewhere"] > 0,
            ),
        ],
        caption="Attention moves information between tokens; the FFN computes on each token alone.",
    )
    return [shapes, params, check]


def _residual(f: dict[str, Any]) -> list[Any]:
    n, s = f["n_layers"], f["scale"]
    rows = [
        (f"plain stack, each layer x{s}", f["gradient_without_skips"], f"{s}^{n}"),
        (f"with skips, y = x + {s} x", f["gradient_with_skips"], f"(1 + {s})^{n}: {f['n_paths']:,} paths"),
        ("  the path through every skip", f["identity_path"], "identity term, weight 1"),
        (f"  the path through all {n} sublayers", f["all_sublayers_path"], f"{s}^{n}"),
        ("plain stack, sublayers dead (F = 0)", f["dead_sublayers_without_skips"], "nothing gets through"),
        ("with skips, sublayers dead (F = 0)", f["dead_sublayers_with_skips"], "the identity path survives"),
    ]
    return [
        table(
            f"Gradient d out / d in through {n} layers, measured with autograd",
            ["wiring", "gradient", "why"],
            rows,
            caption=f"Sum over all paths = {cell(f['sum_of_paths'])}, equal to the measured gradient with skips.",
        )
    ]


def _layernorm(f: dict[str, Any]) -> list[Any]:
    stats = table(
        "Statistics over the features of one token",
        ["x", "mean", "variance", "std", "rms"],
        [(vector(f["x"], 0), f["mean"], f["variance"], f["std"], f["rms"])],
    )
    vectors = table(
        f"Normalized (eps {f['eps']:g})",
        ["step", "values", "mean", "variance"],
        [
            ("x - mean", vector(f["deviations"], 0), None, None),
            ("LayerNorm, gamma 1, beta 0", vector(f["normalized"]), f["normalized_mean"], f["normalized_variance"]),
            (f"LayerNorm, gamma {f['gamma']:g}, beta {f['beta']:g}", vector(f["scaled"]), None, None),
            ("RMSNorm, gamma 1 (x / rms)", vector(f["rmsnorm"]), f["rmsnorm_mean"], None),
        ],
        caption="RMSNorm skips the mean subtraction: its output keeps a nonzero mean.",
    )
    return [stats, vectors]


def _assembly(f: dict[str, Any]) -> list[Any]:
    post, pre = f["placements"]["post"], f["placements"]["pre"]
    labels = ["attention sublayer", "feed-forward sublayer", "after the last block"]
    rows: list[tuple[Any, ...]] = [
        (label, _at(post["formulas"], i), _at(pre["formulas"], i)) for i, label in enumerate(labels)
    ]
    rows.append(("block(x) equals the formula", post["matches_block"], pre["matches_block"]))
    rows.append(("|block(x) - x| / |x| at init", post["relative_change"], pre["relative_change"]))
    formulas = table(None, ["", "post-LN (original)", "pre-LN (modern default)"], rows)
    trace = table(
        f"Shapes through one pre-LN block, from forward hooks on a {shape(f['input_shape'])} input",
        ["module", "kind", "input", "output"],
        [
            ("  " * r["module"].count(".") + r["module"], r["kind"], _shapes(r["input"]), _shapes(r["output"]))
            for r in f["trace"]
        ],
        caption=f"(B, T, C) in and out; the FFN widens to {f['widest']} inside.",
    )
    return [formulas, trace]


def _at(items: list[str], i: int) -> str:
    return items[i] if i < len(items) else "-"


def _shapes(shapes: list[list[int]]) -> str:
    return ", ".join(shape(s) for s in shapes)


PARAMETER_ROWS = {
    "attention": "attention (Q, K, V, output)",
    "feedforward": "feed-forward (W1, W2)",
    "norms": "two LayerNorms",
    "block": "one block",
    "rule_of_thumb": "rule of thumb 12 d^2",
    "blocks": "all blocks",
    "token_embedding": "token embedding",
    "position_embedding": "position embedding",
    "final_norm": "final LayerNorm",
    "lm_head": "LM head",
    "total": "total",
}


def _parameters(f: dict[str, Any]) -> list[Any]:
    rows = []
    for key, label in PARAMETER_ROWS.items():
        r = f[key]
        match = None if r["measured"] is None else r["measured"] == r["analytic"]
        rows.append((label, r["formula"], r["analytic"], r["measured"], match))
    caption = (
        f"The FFN holds {f['ffn_share_of_block']:.0%} of each block; the blocks hold "
        f"{f['blocks_share_of_total']:.0%} of this small model. Head tied to the token embedding: "
        f"{'yes' if f['head_is_token_embedding'] else 'no'}."
    )
    return [table(None, ["component", "formula", "analytic", "measured (numel)", "equal"], rows, caption=caption)]


def _architectures(f: dict[str, Any]) -> list[Any]:
    families = table(
        "One block, three wirings (lesson sizes; masks seen in a real forward pass)",
        ["family", "self-attention mask", "sublayers per block", "parameters", "measured", "future weights", "suits"],
        [
            (
                f"{r['arch']} ({r['example']})",
                r["mask"],
                " / ".join(str(n) for n in r["sublayers_per_block"]),
                r["parameters"],
                r["measured"],
                "all zero" if r["future_weights_zero"] else "nonzero",
                r["use"],
            )
            for r in f["families"]
        ],
    )
    c = f["causal_softmax"]
    softmax = table(
        "The causal mask, by a real attention layer: scores masked to -inf before the softmax",
        ["query", "scores", "exp (row 2)", "mask, then softmax", "row sum", "softmax, then zero (bug)", "row sum"],
        [
            (
                i + 1,
                vector(c["scores"][i], 1),
                vector(c["last_row_exp"]) if i == len(c["scores"]) - 1 else "-",
                vector(c["weights"][i]),
                c["row_sums"][i],
                vector(c["masked_after_softmax"][i]),
                c["row_sums_masked_after"][i],
            )
            for i in range(len(c["scores"]))
        ],
        caption=f"exp sum of row 2: {c['last_row_exp_sum']:.3f}. Masking after the softmax leaks: "
        f"rows no longer sum to one.",
    )
    x = f["cross_attention"]
    t, s = len(x["map"]), len(x["map"][0])
    cross = table(
        f"Cross-attention, head 1 of {shape(x['shape'])}: {t} decoder queries over {s} source tokens (untrained)",
        ["query"] + [f"src {j + 1}" for j in range(s)] + ["row sum"],
        [(f"tgt {i + 1}", *row, x["row_sums"][i]) for i, row in enumerate(x["map"])],
        caption="No causal mask: every query sees the whole source.",
    )
    return [families, softmax, cross]


def _tiny(f: dict[str, Any]) -> list[Any]:
    shapes = table(
        f"Shapes ({f['parameters']:,} parameters)",
        ["stage", "module", "shape"],
        [(r["stage"], r["module"] or "-", shape(r["shape"])) for r in f["shapes"]]
        + [("attention weights (B, H, T, T)", "blocks.0.attn", shape(f["attention_shape"]))],
    )
    checks = table(
        "Sanity checks (oneblock.analysis.checks.run_checks)",
        ["check", "passed", "detail"],
        [(c["name"], c["passed"], c["detail"]) for c in f["checks"]],
    )
    return [shapes, checks]


RENDERERS = {
    "gelu": _gelu,
    "feedforward": _feedforward,
    "residual": _residual,
    "layernorm": _layernorm,
    "assembly": _assembly,
    "parameters": _parameters,
    "architectures": _architectures,
    "tiny": _tiny,
}
