"""``oneblock count``: analytic parameter counts, FLOPs per token and weight memory of a configuration."""

from __future__ import annotations

import argparse
from typing import Any

from oneblock.cli import lora_options, options

BREAKDOWN_LABELS = {
    "token_embedding": "token embedding",
    "position_embedding": "position embedding",
    "relative_position_bias": "relative position bias (T5)",
    "token_type_embedding": "segment (token type) embedding",
    "embedding_norm": "embedding norm",
    "attention": "self-attention",
    "cross_attention": "cross-attention (+ its norm)",
    "feedforward": "feed-forward",
    "block_norms": "block norms",
    "final_norm": "final norm",
    "pooler": "pooler",
    "lm_head": "LM head (untied)",
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "count",
        help="count parameters, FLOPs per token and weight memory from the config alone",
        description=(
            "Count the parameters of a configuration analytically, without building the model: the breakdown "
            "by component, one block, the 12 d_model^2 rule of thumb, the non-embedding count, forward FLOPs "
            "per token and the memory the weights take. --verify also builds the model and compares with "
            "sum(p.numel())."
        ),
    )
    options.add_model_options(parser)
    parser.add_argument(
        "--seq-len",
        type=int,
        metavar="T",
        help="context length for the attention FLOPs (default: the config's max_seq_len)",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="build the model (on the meta device: no memory) and compare with sum(p.numel()); exit 1 on mismatch",
    )
    parser.add_argument(
        "--diff",
        action="store_true",
        help="also list how the block differs from the lesson's, one option per row, each with the parameters it "
        "adds or removes (count of the config less the count with that option switched back)",
    )
    lora = parser.add_argument_group("LoRA adapters (the flags of oneblock finetune)")
    lora_options.add_lora_options(lora, rank=None, counting=True)
    options.add_json_option(parser)
    return parser


def figures(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``count`` reports, as plain data."""
    from oneblock.analysis.counting import count_flops, count_parameters, weight_memory
    from oneblock.errors import InputError

    cfg = options.config_only(args)
    if args.seq_len is not None and args.seq_len <= 0:
        raise InputError(f"--seq-len must be a positive integer; got {args.seq_len}")
    count = count_parameters(cfg)
    data: dict[str, Any] = {
        "model": options.describe(args),
        "config": cfg.to_dict(),
        **count.as_dict(),
        "flops_per_token": count_flops(cfg, args.seq_len),
        "memory_bytes": weight_memory(cfg),
    }
    if args.diff:
        from oneblock.analysis.block_diff import block_differences

        data["block_diff"] = [row.as_dict() for row in block_differences(cfg)]
    lora = lora_options.lora_config(args) if args.lora_rank is not None else None
    if lora is not None:
        from oneblock.adapters.counting import lora_parameters

        trainable = lora_parameters(cfg, lora.rank, lora.targets)
        data["lora"] = {
            "rank": lora.rank,
            "targets": list(lora.targets),
            "trainable": trainable,
            "share_of_base": trainable / count.total,
        }
    if args.verify:
        model, _ = options.model_and_config(args, meta=True)
        measured = sum(p.numel() for p in model.parameters())  # parameters() yields a tied matrix once
        data["measured"] = measured
        data["verified"] = measured == count.total
        if lora is not None:
            from oneblock.adapters.apply import adapter_state_dict, apply_lora

            apply_lora(model, lora)
            built = sum(p.numel() for p in adapter_state_dict(model).values())
            data["lora"]["measured"] = built
            data["verified"] = data["verified"] and built == data["lora"]["trainable"]
    return data


def run(args: argparse.Namespace) -> int:
    data = figures(args)
    status = 0 if data.get("verified", True) else 1
    if args.json:
        from oneblock.cli.render import print_json

        print_json(data)
        return status
    _render(data)
    return status


def _render(data: dict[str, Any]) -> None:
    from oneblock.cli.render import console, heading, human_bytes, table

    cfg, total = data["config"], data["total"]
    out = console()
    out.print(
        heading(
            f"{data['model']}: {cfg['arch']}, d_model {cfg['d_model']}, {cfg['n_heads']} heads, "
            f"{cfg['n_layers']} layers, d_ff {cfg['d_ff']}, vocab {cfg['vocab_size']:,}"
        )
    )
    breakdown = table(
        None,
        ["component", "parameters", "share"],
        [(label, v, f"{v / total:.1%}") for label, v in _labelled(data)] + [("total", total, "100.0%")],
        caption="Tied matrices are counted once; buffers (rotary tables, BART's logits bias) are not parameters.",
    )
    out.print(breakdown)
    summary = [
        ("one block", data["per_block"], "attention + feed-forward + norms"),
        ("rule of thumb", data["rule_of_thumb"], "12 x d_model^2"),
        ("non-embedding", data["non_embedding"], "total less token, position and segment tables"),
    ]
    if data["per_decoder_block"] != data["per_block"]:
        summary.insert(1, ("one decoder block", data["per_decoder_block"], "adds cross-attention and its norm"))
    flops = data["flops_per_token"]
    summary += [
        ("forward FLOPs / token", flops["total"], f"at T = {flops['seq_len']:,}; a multiply-add is 2 FLOPs"),
        ("  matrix products", flops["matmul"], "2 x block weights"),
        ("  attention scores + sum", flops["attention"], f"causal average {flops['attention_causal']:,}"),
        ("  LM head", flops["head"], "2 x vocab x d_model"),
        ("weights at fp32", human_bytes(data["memory_bytes"]["fp32"]), f"{data['memory_bytes']['fp32']:,} bytes"),
        ("weights at bf16", human_bytes(data["memory_bytes"]["bf16"]), f"{data['memory_bytes']['bf16']:,} bytes"),
    ]
    if "lora" in data:
        lora = data["lora"]
        summary.append(
            (
                f"LoRA rank {lora['rank']} (trainable)",
                lora["trainable"],
                f"{lora['share_of_base']:.2%} of the base; on {','.join(lora['targets'])}",
            )
        )
    if "measured" in data:
        summary.append(("measured sum(p.numel())", data["measured"], "equal" if data["verified"] else "MISMATCH"))
    out.print(table(None, ["figure", "value", "note"], summary))
    if "block_diff" in data:
        _render_diff(out, data["block_diff"])


def _render_diff(out: Any, rows: list[dict[str, Any]]) -> None:
    from oneblock.cli.render import table

    if not rows:
        out.print("The block is the lesson's: no option differs.")
        return
    differences = table(
        "How the block differs from the lesson's",
        ["difference", "parameters", "why"],
        [(row["label"], _signed(row["parameters"]), row["note"]) for row in rows],
        caption="Each row: this count less the count with that one option switched back to the lesson's.",
    )
    differences.columns[1].justify = "right"  # signed figures are strings
    out.print(differences)


def _signed(parameters: int | None) -> str:
    """``+1,234``, ``-1,234``, ``0``; ``n/a`` where the lesson's choice cannot apply to these sizes."""
    return "n/a" if parameters is None else f"{parameters:+,}" if parameters else "0"


def _labelled(data: dict[str, Any]) -> list[tuple[str, int]]:
    return [(label_of(key), value) for key, value in data["breakdown"].items()]


def label_of(key: str) -> str:
    """The readable label of a breakdown key; an encoder-decoder's keep their stack: ``decoder cross-attention``."""
    stack, _, part = key.rpartition(".")
    label = BREAKDOWN_LABELS.get(part, part)
    return f"{stack} {label}" if stack else label
