"""Flags shared by the subcommands: a model configuration (a preset, overridden flag by flag), a
checkpoint, the random seed and ``--json``.

Nothing heavy is imported at module level; ``oneblock --help`` builds every parser and should stay fast.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any

from oneblock.config import ACTIVATIONS, ARCHS, FFNS, NORM_POSITIONS, NORMS, POSITIONS, ModelConfig
from oneblock.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

DEFAULT_PRESET = "lesson"

# flag destination -> ModelConfig field, for the flags that carry a value.
_FIELDS: dict[str, str] = {
    "arch": "arch",
    "vocab_size": "vocab_size",
    "d_model": "d_model",
    "n_heads": "n_heads",
    "n_kv_heads": "n_kv_heads",
    "n_layers": "n_layers",
    "d_ff": "d_ff",
    "max_seq_len": "max_seq_len",
    "norm_position": "norm_position",
    "norm": "norm",
    "activation": "activation",
    "ffn": "ffn",
    "position": "position",
    "dropout": "dropout",
}


def _preset_names() -> str:
    from oneblock.presets import PRESETS

    return ", ".join(PRESETS)


def add_model_options(parser: argparse.ArgumentParser, *, checkpoint: bool = True) -> None:
    """Add ``--preset``, one flag per config field and, optionally, ``--checkpoint``.

    Every flag defaults to ``None`` ("keep the preset's value") so that ``config_from_args`` can tell which
    were given.
    """
    group = parser.add_argument_group("model configuration (flags override the preset)")
    group.add_argument(
        "--preset",
        default=None,
        metavar="NAME",
        help=f"start from a named configuration: {_preset_names()} (default: {DEFAULT_PRESET})",
    )
    group.add_argument("--arch", choices=ARCHS, help="model family: encoder, decoder or encoder-decoder")
    group.add_argument("--vocab-size", type=int, metavar="V", help="number of token ids")
    group.add_argument("--d-model", type=int, metavar="C", help="model width, the residual stream's size")
    group.add_argument("--n-heads", type=int, metavar="H", help="attention (query) heads; must divide d_model")
    group.add_argument(
        "--n-kv-heads",
        type=int,
        metavar="HKV",
        help="key/value heads for grouped-query attention; must divide H",
    )
    group.add_argument("--n-layers", type=int, metavar="N", help="blocks per stack")
    group.add_argument(
        "--d-ff",
        type=int,
        metavar="F",
        help="feed-forward hidden width (default: 4 x d_model for a new d_model)",
    )
    group.add_argument("--max-seq-len", type=int, metavar="T", help="longest sequence (context length)")
    group.add_argument(
        "--norm-position", choices=NORM_POSITIONS, help="pre-LN x + f(norm(x)) or post-LN norm(x + f(x))"
    )
    group.add_argument("--norm", choices=NORMS, help="layernorm (mean and variance) or rmsnorm (root mean square)")
    group.add_argument("--activation", choices=ACTIVATIONS, help="activation of the feed-forward network")
    group.add_argument("--ffn", choices=FFNS, help="feed-forward kind: mlp, swiglu, or gated (T5 v1.1)")
    group.add_argument("--position", choices=POSITIONS, help="learned table, rotary (rope), T5 relative bias or none")
    group.add_argument("--no-bias", action="store_true", default=None, help="drop the biases of the Linear layers")
    group.add_argument(
        "--untied", action="store_true", default=None, help="give the LM head its own matrix (default: tied)"
    )
    group.add_argument("--dropout", type=finite_float, metavar="P", help="dropout probability in [0, 1)")
    if checkpoint:
        group.add_argument(
            "--checkpoint",
            metavar="PATH",
            help="load a oneblock checkpoint (weights and config) instead of building from flags",
        )


def add_adapter_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--adapter DIR`` (a peft LoRA adapter put on the model) and ``--merge`` (folded into its weights)."""
    parser.add_argument(
        "--adapter",
        metavar="DIR",
        help="a peft LoRA adapter directory (adapter_config.json + adapter_model.safetensors) to run the model with",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="fold the adapter into the weights (as fast as the base model; needs float weights)",
    )


def check_adapter_options(args: argparse.Namespace) -> None:
    """Refuse ``--merge`` without ``--adapter``."""
    if getattr(args, "merge", False) and getattr(args, "adapter", None) is None:
        raise ConfigError("--merge folds an adapter into the weights; give --adapter DIR too")


def set_threads(threads: int | None) -> None:
    """Apply ``--threads N`` (``None`` keeps torch's default)."""
    if threads is None:
        return
    if threads <= 0:
        raise ConfigError(f"--threads must be a positive integer; got {threads}")
    import torch

    torch.set_num_threads(threads)


def refuse_flags_on_resume(given: list[str]) -> None:
    """Refuse flags that ``--resume`` would ignore: the run continues with its saved ``config.json``."""
    if given:
        raise ConfigError(
            f"--resume continues with the run's saved config.json; drop {', '.join(given)} (or start a new --out)"
        )


def finite_float(text: str) -> float:
    """An argparse ``type``: a float that is neither NaN nor infinite (``--lr inf`` is refused at parse time)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number; got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number; got {text!r}")
    return value


def seed(text: str) -> int:
    """An argparse ``type``: a random seed, an integer in [0, 2**63)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer; got {text!r}") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**63); got {text}")
    return value


def add_seed_option(parser: argparse.ArgumentParser, default: int = 0) -> None:
    parser.add_argument(
        "--seed", type=seed, default=default, help=f"random seed for weights and inputs (default: {default})"
    )


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on stdout instead of tables")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    changes = {field: getattr(args, dest) for dest, field in _FIELDS.items() if getattr(args, dest, None) is not None}
    if getattr(args, "no_bias", None):
        changes["bias"] = False
    if getattr(args, "untied", None):
        changes["tie_embeddings"] = False
    return changes


def config_from_args(args: argparse.Namespace) -> ModelConfig:
    """The ``ModelConfig`` the flags describe: the preset with the given flags applied.

    Raises:
        ConfigError: an unknown preset or an impossible combination, e.g.
            ``n_heads (3) must divide d_model (64)``.
    """
    from oneblock.presets import get_preset

    preset = args.preset if args.preset is not None else DEFAULT_PRESET
    cfg = get_preset(preset)
    changes = _overrides(args)
    return cfg.replace(**changes) if changes else cfg


def describe(args: argparse.Namespace) -> str:
    """A label for what the flags describe: ``gpt2``, ``lesson + d_model=128``, ``checkpoint model.st``."""
    if getattr(args, "checkpoint", None):
        return f"checkpoint {args.checkpoint}"
    preset = args.preset if args.preset is not None else DEFAULT_PRESET
    changes = _overrides(args)
    if not changes:
        return preset
    return preset + " + " + ", ".join(f"{k}={v}" for k, v in changes.items())


def load_checkpoint(path: str) -> nn.Module:
    """The model stored at ``path`` by ``oneblock.io.checkpoint.save`` (its config is ``model.config``)."""
    from oneblock.io import checkpoint

    return checkpoint.load(path)


def _refuse_mixed(args: argparse.Namespace) -> None:
    given = [dest for dest in _FIELDS if getattr(args, dest, None) is not None]
    given += [d for d in ("no_bias", "untied") if getattr(args, d, None)]
    if args.preset is not None:
        given.insert(0, "preset")
    if given:
        flags = ", ".join("--" + d.replace("_", "-") for d in given)
        raise ConfigError(f"--checkpoint carries its own config; drop {flags} or drop --checkpoint")


def model_and_config(
    args: argparse.Namespace, *, seed: int | None = None, meta: bool = False
) -> tuple[nn.Module, ModelConfig]:
    """``(model, cfg)`` from ``--checkpoint`` or from the config flags.

    Args:
        args: parsed flags.
        seed: seed ``torch`` before building, so random weights are reproducible.
        meta: build on the meta device (shapes and counts only, no memory, no time); ignored for checkpoints.
    """
    import torch

    if getattr(args, "checkpoint", None):
        _refuse_mixed(args)
        from oneblock.models.inputs import config_of

        model = load_checkpoint(args.checkpoint)
        model.eval()
        return model, config_of(model)
    from oneblock.models import build_model

    cfg = config_from_args(args)
    if seed is not None:
        torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            model = build_model(cfg)
    else:
        model = build_model(cfg)
    model.eval()
    return model, cfg


def config_only(args: argparse.Namespace) -> ModelConfig:
    """The config of ``--checkpoint`` (read from its header) or of the flags; builds nothing."""
    if getattr(args, "checkpoint", None):
        _refuse_mixed(args)
        from oneblock.io import checkpoint

        return checkpoint.read_info(args.checkpoint).config
    return config_from_args(args)
