"""The fine-tuning experiment's report: a markdown table, a PNG and the verdict.

``finetune.png`` has two panels: held-out exact match before and after training per row (bars), and held-out
exact match after training against trainable parameters (log scale), the cost-benefit picture of the claim.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from oneblock.io import files

COLUMNS = ("row", "trainable parameters", "% of the model", "peak RSS (MB)", "train tokens/s", "held-out loss",
           "exact match", "wall (s)")  # fmt: skip


def table_rows(results: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """One row of strings per configuration, in ``COLUMNS`` order; the share is of full fine-tuning's count (every
    parameter of the model)."""
    total = next((r["trainable"] for r in results if r["row"]["method"] == "full"), None)
    rows: list[tuple[str, ...]] = []
    for r in results:
        share = f"{100 * r['trainable'] / total:.2f}%" if total else "-"
        b, a = r["before"], r["after"]
        rows.append((r["row"]["name"], f"{r['trainable']:,}", share, f"{r['peak_rss_mb']:,.0f}",
                     f"{r['tokens_per_s']:.0f}", f"{b['loss']:.3f} → {a['loss']:.3f}",
                     f"{b['exact_match']:.3f} → {a['exact_match']:.3f}", f"{r['wall_seconds']:.0f}"))  # fmt: skip
    return rows


def markdown_table(results: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|:---|" + "---:|" * (len(COLUMNS) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results)]
    return "\n".join(lines)


def preference_lines(results: list[dict[str, Any]]) -> list[str]:
    """What the DPO row learnt, on held-out pairs."""
    out = []
    for r in results:
        if "preference" not in r["after"]:
            continue
        b, a = r["before"]["preference"], r["after"]["preference"]
        out.append(
            f"{r['row']['name']}: on held-out pairs, the model gives the label a higher log-probability than the "
            f"plain sentence in {b['preference_accuracy']:.3f} of pairs before and {a['preference_accuracy']:.3f} "
            f"after (mean log-probability gap {b['logp_margin']:+.2f} -> {a['logp_margin']:+.2f} nats); DPO reward "
            f"margin {a['reward_margin']:+.3f}, reward accuracy {a['reward_accuracy']:.3f}, held-out DPO loss "
            f"{b['loss']:.4f} -> {a['loss']:.4f}"
        )
    return out


def plot(results: list[dict[str, Any]], path: str | Path) -> Path:
    """Draw the two panels described in the module docstring."""
    from oneblock.analysis.plotting import require_matplotlib

    plt = require_matplotlib()
    names = [r["row"]["name"] for r in results]
    before = [r["before"]["exact_match"] for r in results]
    after = [r["after"]["exact_match"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    xs = range(len(names))
    left.bar([x - 0.2 for x in xs], before, width=0.4, label="before", color="#bbbbbb")
    left.bar([x + 0.2 for x in xs], after, width=0.4, label="after", color="#3a7bd5")
    left.set_xticks(list(xs), names, rotation=20, fontsize=8)
    left.set_ylim(0, 1.05)
    left.set_ylabel("held-out exact match")
    left.legend(fontsize=8)
    left.set_title("greedy answers equal to the label", fontsize=9)
    for r, name in zip(results, names, strict=True):
        right.scatter(r["trainable"], r["after"]["exact_match"], s=40)
        right.annotate(name, (r["trainable"], r["after"]["exact_match"]), fontsize=8, xytext=(4, 4),
                       textcoords="offset points")  # fmt: skip
    right.set_xscale("log")
    right.set_ylim(-0.05, 1.1)
    right.set_xlabel("trainable parameters")
    right.set_ylabel("held-out exact match after training")
    right.set_title("what each row trains, and what it reaches", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def write_report(report: dict[str, Any], out_dir: str | Path) -> dict[str, Any]:
    """``finetune.png``, ``finetune.md`` and ``finetune.json`` in ``out_dir``; returns ``report`` with their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = report["rows"]
    png = plot(results, out / "finetune.png")
    setup, verdict = report["setup"], report["verdict"]
    examples = []
    for r in results:
        if r["row"]["name"] == "lora-r8":
            examples = list(zip(r["before"]["answers"][:3], r["after"]["answers"][:3], strict=True))
    text = "\n".join(
        [
            "# Fine-tuning SmolLM2-135M-Instruct: full, LoRA ranks 2/8/32, a 4-bit base, DPO",
            "",
            f"{setup['n_train']} training orders, {setup['n_held_out']} held-out ones (no shared prompt), "
            f"{setup['steps']} steps of {setup['batch_size']}, seed {setup['seed']}, {setup['threads']} threads.",
            "",
            markdown_table(results),
            "",
            *[f"- {line}" for line in preference_lines(results)],
            *[f"- lora-r8, before: {b!r}; after: {a!r}" for b, a in examples],
            "",
            f"**Verdict: {verdict['outcome']}** ({verdict['why']}).",
            "",
        ]
    )
    files.write_atomic(out / "finetune.md", [text.encode()], what="report")
    files.write_atomic(out / "finetune.json", [json.dumps(report, indent=2).encode()], what="report")
    return {**report, "png": str(png), "markdown": str(out / "finetune.md")}
