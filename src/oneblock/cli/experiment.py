"""``oneblock experiment``: measure two of the lesson's claims instead of taking them on trust.

- ``residuals``: the gradient norm reaching the first block of stacks of 1..48 blocks at initialization, with and
  without the skip connections (the lesson's "0.5^12 = 0.000244 without skips" argument, measured).
- ``norm-placement``: pre-LN against post-LN at depths 2, 6, 12 and 24: per-layer gradient norms at
  initialization and training curves with and without warmup at two learning rates, with a verdict per setting.
- ``warmup``: does pre-LN need less warmup? Pre-LN vs post-LN, with and without linear warmup, over a range of
  learning rates at depths 6 and 12 and three seeds; a heat map of the final held-out losses and a verdict by the
  rule stated in docs/experiments.md.
- ``finetune``: SmolLM2-135M-Instruct taught a made-up label format by full fine-tuning, LoRA of ranks 2, 8 and 32
  (float32 base), LoRA rank 8 over the 4-bit base and DPO: trainable parameters, peak RSS, tokens/s, held-out
  loss and exact match before and after, and the verdict on "LoRA rank 8 reaches 90% of full fine-tuning's
  exact match with under 2% of its parameters". ``--quick`` runs it on a tiny random model.

Each writes a PNG and a markdown report to ``--out``. ``--quick`` runs a reduced version in well under a minute.
"""

from __future__ import annotations

import argparse
from typing import Any

from oneblock.cli import options

EXPERIMENTS = ("residuals", "norm-placement", "warmup", "finetune")
SHOWN_DEPTHS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48)  # rows of the residuals table on screen (all are in the .md)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "experiment",
        help="measure the lesson's claims: residuals and gradient flow, pre-LN vs post-LN (PNG + table)",
        description=(
            "residuals: first-block gradient norm of stacks of 1..48 blocks at initialization, with and without "
            "skip connections. norm-placement: pre-LN vs post-LN at depths 2, 6, 12, 24: gradient norm per block "
            "at initialization, and byte-level decoder training with and without warmup at two learning rates, "
            "flagging diverged and stalled runs. warmup: pre-LN vs post-LN with and without warmup over five "
            "learning rates, depths 6 and 12, three seeds: final held-out losses as a heat map and a verdict. "
            "finetune: full fine-tuning vs LoRA ranks 2/8/32, a 4-bit base and DPO on SmolLM2-135M-Instruct, "
            "scored by held-out exact match (--threads 2 by default for it). "
            "Writes <name>.png and <name>.md to --out; needs matplotlib."
        ),
    )
    parser.add_argument("name", choices=EXPERIMENTS, help="which experiment to run")
    parser.add_argument(
        "--quick", action="store_true", help="fewer depths, steps and seeds: a smoke run in well under a minute"
    )
    parser.add_argument(
        "--out", default="experiments", metavar="DIR", help="directory for the PNG and report (default: experiments)"
    )
    parser.add_argument(
        "--force", action="store_true",
        help="finetune: write into a non-empty --out, replacing an earlier run's adapters and report",
    )  # fmt: skip
    options.add_threads_option(
        parser, note="; the models are tiny, so more threads mostly add overhead (1; 2 for finetune)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    options.add_json_option(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from oneblock.analysis.plotting import require_matplotlib
    from oneblock.cli.render import print_json

    require_matplotlib()  # fail before minutes of work if the figure cannot be drawn
    _check_out(args)
    if args.threads is None:
        args.threads = 2 if args.name == "finetune" else 1
    options.set_threads(args.threads)
    runners = {"residuals": _residuals, "norm-placement": _norm_placement, "warmup": _warmup, "finetune": _finetune}
    report = runners[args.name](args)
    if args.json:
        print_json(report)
    else:
        _show(args.name, report)
    return 0


def _check_out(args: argparse.Namespace) -> None:
    """Refuse an --out that is not a directory, and (finetune) a non-empty one without --force, before any work;
    with --force, the earlier fine-tuning run's own adapters and report go first, so none is left mixed in."""
    from pathlib import Path

    from oneblock.errors import ConfigError
    from oneblock.io.files import special_kind

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        kind = "a file" if out.is_file() else (special_kind(out) or "not a directory")
        raise ConfigError(f"--out {str(out)!r} is {kind}; the experiment writes a directory: give one")
    if args.name != "finetune" or not out.is_dir():
        return
    from oneblock.finetune.experiment import clear_products

    entries = sorted(p.name for p in out.iterdir())
    if entries and not args.force:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise ConfigError(
            f"--out {str(out)!r} is not empty ({len(entries)} entries: {shown}); pass --force to replace an earlier "
            "run's adapters and report there, or choose an empty directory"
        )
    if entries:
        clear_products(out)


def _progress(total: int, label: str, enabled: bool) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True), disable=not enabled,
    )  # fmt: skip
    progress.add_task(label, total=total)
    return progress


def _residuals(args: argparse.Namespace) -> dict[str, Any]:
    from oneblock.train.experiments import residuals

    depths = residuals.QUICK_DEPTHS if args.quick else residuals.FULL_DEPTHS
    seeds = 1 if args.quick else 3
    with _progress(len(depths), "residuals", not args.quiet) as bar:
        results = residuals.run(depths, seeds=seeds, progress=lambda _: bar.advance(bar.task_ids[0]))
    return residuals.write_report(results, args.out)


def _norm_placement(args: argparse.Namespace) -> dict[str, Any]:
    from oneblock.train.experiments import norm_placement, norm_placement_report

    setup = norm_placement.Setup.quick() if args.quick else norm_placement.Setup.full()
    total = len(setup.depths) * len(setup.lrs) * 4
    with _progress(total, "norm-placement", not args.quiet) as bar:
        results = norm_placement.run_all(setup, progress=lambda _: bar.advance(bar.task_ids[0]))
    return norm_placement_report.write_report(results, args.out)


def _warmup(args: argparse.Namespace) -> dict[str, Any]:
    from oneblock.train.experiments import warmup, warmup_report

    setup = warmup.Setup.quick() if args.quick else warmup.Setup.full()
    with _progress(setup.n_runs, "warmup", not args.quiet) as bar:
        results = warmup.run_all(setup, progress=lambda _: bar.advance(bar.task_ids[0]))
    return warmup_report.write_report(results, args.out)


def _finetune(args: argparse.Namespace) -> dict[str, Any]:
    import dataclasses

    from oneblock.finetune import experiment, experiment_report

    setup = experiment.Setup.quick() if args.quick else experiment.Setup.full()
    setup = dataclasses.replace(setup, threads=args.threads)
    with _progress(len(experiment.ROWS), "finetune", not args.quiet) as bar:
        report = experiment.run_all(setup, out=args.out, progress=lambda _: bar.advance(bar.task_ids[0]))
    return experiment_report.write_report(report, args.out)


def _show(name: str, report: dict[str, Any]) -> None:
    from oneblock.cli.render import console, table

    out = console()
    if name == "residuals":
        columns: tuple[str, ...] = ("depth", "first block, skips", "first block, no skips", "input, skips",
                                    "input, no skips", "0.5^(depth-1)")  # fmt: skip
        keys = ("first_layer_skip", "first_layer_no_skip", "input_skip", "input_no_skip")
        rows = [
            (r["depth"], *(r[k] for k in keys), 0.5 ** (r["depth"] - 1))
            for r in report["results"]
            if r["depth"] in SHOWN_DEPTHS
        ]
        out.print(table("Gradient norms at initialization", columns, rows))
    elif name == "finetune":
        from oneblock.finetune.experiment_report import COLUMNS, preference_lines, table_rows

        out.print(table("Fine-tuning: held-out scores before → after", COLUMNS, table_rows(report["rows"])))
        for line in preference_lines(report["rows"]):
            out.print(f"- {line}", markup=False)
        verdict = report["verdict"]
        out.print(f"verdict: {verdict['outcome']} ({verdict['why']})", markup=False)
    elif name == "warmup":
        out.print(table("Final held-out loss, mean ± sd over seeds", ("depth", "placement", "lr", "no warmup",
                                                                      "warmup"), _warmup_rows(report)))  # fmt: skip
        verdict = report["verdict"]
        out.print(f"verdict: {verdict['outcome']} ({verdict['why']})", markup=False)
    else:
        columns = ("depth", "lr", "warmup", "pre-LN loss", "pre-LN", "post-LN loss", "post-LN")
        out.print(table("Final training loss (mean of the last tenth of the steps)", columns, _loss_rows(report)))
    for line in report.get("findings", report.get("claims", report.get("verdict", {}).get("lines", []))):
        out.print(f"- {line}", markup=False)
    out.print(f"wrote {report['png']} and {report['markdown']}")


def _loss_rows(report: dict[str, Any]) -> list[tuple]:
    """One row per (depth, lr, warmup): pre-LN and post-LN final losses and verdicts."""
    by_setting: dict[tuple, dict[str, dict[str, Any]]] = {}
    for run in report["runs"]:
        by_setting.setdefault((run["depth"], run["lr"], run["warmup"]), {})[run["norm_position"]] = run
    rows = []
    for (depth, lr, warmup), pair in sorted(by_setting.items()):
        pre, post = pair["pre"], pair["post"]
        rows.append((depth, f"{lr:g}", "yes" if warmup else "no", _final(pre), pre["status"], _final(post),
                     post["status"]))  # fmt: skip
    return rows


def _final(run: dict[str, Any]) -> str:
    return "NaN/inf" if run["final"] is None else f"{run['final']:.3f}"


def _warmup_rows(report: dict[str, Any]) -> list[tuple]:
    """One row per (depth, placement, lr): the cell without and with warmup."""
    cells = {(c["depth"], c["norm_position"], c["lr"], c["warmup"]): c for c in report["cells"]}

    def text(cell: dict[str, Any]) -> str:
        return "NaN/inf" if cell["mean"] is None else f"{cell['mean']:.3f} ± {cell['spread']:.3f}"

    keys = sorted({(d, n, lr) for d, n, lr, _ in cells}, key=lambda k: (k[0], k[1] != "pre", k[2]))
    return [(d, f"{n}-LN", f"{lr:g}", text(cells[(d, n, lr, False)]), text(cells[(d, n, lr, True)]))
            for d, n, lr in keys]  # fmt: skip
