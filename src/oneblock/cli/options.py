"""Flags shared by the subcommands: the model (``--model SOURCE``, a preset overridden flag by flag or a file),
threads, numeric precision, the random seed and ``--json`` (the LoRA flags: :mod:`oneblock.cli.lora_options`).

Nothing heavy is imported at module level; ``oneblock --help`` builds every parser and should stay fast.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oneblock.cli.spelling import Spelled, add_alias, flag
from oneblock.config import ACTIVATIONS, ARCHS, FFNS, NORM_POSITIONS, NORMS, POSITIONS, ModelConfig
from oneblock.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from torch import nn

DEFAULT_PRESET = "lesson"
SOURCES = "a GGUF file, a Hugging Face model directory, a oneblock checkpoint or a preset name"
# What ``describe`` calls a model read from a file, by ``source_kind``.
_KIND_LABELS = {"checkpoint": "checkpoint", "gguf": "GGUF file", "hf": "Hugging Face directory"}

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


def add_model_option(
    container: Any, *, help: str, aliases: tuple[str, ...] = (), metavar: str = "SOURCE", default: Any = None
) -> argparse.Action:
    """Add ``--model SOURCE``, the one name for the model a command reads, with ``aliases`` as hidden spellings."""
    action = container.add_argument("--model", action=Spelled, metavar=metavar, default=default, help=help)
    if aliases:
        add_alias(container, *aliases, of=action)
    return action


def source_kind(source: str, flag_name: str = "--model") -> str:
    """``"gguf"``, ``"hf"``, ``"checkpoint"`` or ``"preset"``: what ``oneblock.inference.load.load_model`` reads
    ``source`` as.

    Raises:
        CheckpointError: no such file or directory, and no preset of that name; or a FIFO, device or socket.
    """
    path = Path(source)
    if path.is_file():
        return "gguf" if path.suffix.lower() == ".gguf" else "checkpoint"
    if path.is_dir():
        return "hf"
    from oneblock.io.files import special_kind

    kind = special_kind(path)
    if kind is not None:  # a FIFO, device or socket: there, but nothing a model is read from
        raise CheckpointError(
            f"{flag_name} {source!r} is {kind}, not a regular file; give a .gguf file, a Hugging Face model "
            "directory, a oneblock checkpoint or a preset name"
        )
    from oneblock.presets import PRESETS

    if source in PRESETS:
        return "preset"
    raise CheckpointError(
        f"{flag_name} {source!r} does not exist (no such file or directory) and is no preset name (unknown preset "
        f"{source!r}); give a .gguf file, a Hugging Face model directory, a oneblock checkpoint or one of the presets "
        f"{_preset_names()}"
    )


def add_model_options(parser: argparse.ArgumentParser, *, files: bool = True) -> None:
    """Add ``--model`` (a preset name, or with ``files`` any file ``load_model`` reads) and one flag per config field.

    ``--preset`` (and, with ``files``, ``--checkpoint``) stay as hidden aliases of ``--model``. Every config flag
    defaults to ``None`` ("keep the preset's value") so that ``config_from_args`` can tell which were given.
    """
    group = parser.add_argument_group("model configuration (flags override the preset)")
    if files:
        add_model_option(
            group,
            aliases=("--preset", "--checkpoint"),
            help=f"a preset name ({_preset_names()}; default: {DEFAULT_PRESET}), overridden by the flags below, or "
            "a GGUF file, Hugging Face directory or oneblock checkpoint, which carry their own config (a GGUF file is "
            "read as float32)",
        )
    else:
        add_model_option(
            group,
            aliases=("--preset",),
            metavar="NAME",
            help=f"the preset to start from, with fresh weights: {_preset_names()} (default: {DEFAULT_PRESET})",
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


def add_threads_option(parser: Any, *, default: int | None = None, note: str = "") -> None:
    """Add ``--threads N``: the CPU threads torch computes with (``set_threads`` applies it)."""
    shown = "torch's choice" if default is None else str(default)
    parser.add_argument(
        "--threads", type=int, default=default, metavar="N", help=f"CPU threads for torch{note} (default: {shown})"
    )


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


def file_kind(args: argparse.Namespace) -> str | None:
    """What ``--model`` names when it is a file (``"gguf"``, ``"hf"``, ``"checkpoint"``); ``None`` for a preset."""
    source = getattr(args, "model", None)
    if source is None:
        return None
    kind = source_kind(source, flag(args, "model"))
    return None if kind == "preset" else kind


def _preset(args: argparse.Namespace) -> str:
    source = getattr(args, "model", None)
    return source if source is not None else DEFAULT_PRESET


def config_from_args(args: argparse.Namespace) -> ModelConfig:
    """The ``ModelConfig`` the flags describe: the preset with the given flags applied.

    Raises:
        ConfigError: an impossible combination, e.g. ``n_heads (3) must divide d_model (64)``, or a file where
            only a preset can stand (``oneblock train`` builds fresh weights).
        CheckpointError: ``--model`` names neither a file nor a preset.
    """
    from oneblock.presets import get_preset

    kind = file_kind(args)
    if kind is not None:
        named = flag(args, "model")
        raise ConfigError(
            f"{named} {args.model!r} is a {_KIND_LABELS[kind]}; this command builds fresh weights from a preset "
            f"({_preset_names()}): give a preset name (oneblock finetune --model trains a model from a file)"
        )
    cfg = get_preset(_preset(args))
    changes = _overrides(args)
    return cfg.replace(**changes) if changes else cfg


def describe(args: argparse.Namespace) -> str:
    """A label for what the flags describe: ``gpt2``, ``lesson + d_model=128``, ``checkpoint model.st``."""
    kind = file_kind(args)
    if kind is not None:
        return f"{_KIND_LABELS[kind]} {args.model}"
    preset = _preset(args)
    changes = _overrides(args)
    if not changes:
        return preset
    return preset + " + " + ", ".join(f"{k}={v}" for k, v in changes.items())


def config_flags_given(args: argparse.Namespace) -> list[str]:
    """The config flags given (``--d-model``, ``--no-bias``, ...), as they are spelled."""
    given = [dest for dest in _FIELDS if getattr(args, dest, None) is not None]
    given += [d for d in ("no_bias", "untied") if getattr(args, d, None)]
    return ["--" + d.replace("_", "-") for d in given]


def _refuse_mixed(args: argparse.Namespace) -> None:
    given = config_flags_given(args)
    if given:
        named = flag(args, "model")
        raise ConfigError(f"{named} carries its own config; drop {', '.join(given)} or drop {named}")


def _from_file(args: argparse.Namespace, kind: str, *, exact: bool = True) -> nn.Module:
    """The model of a file, in eval mode; with ``exact``, a GGUF file as its float32 model (real parameters, not
    4-bit codes), else as stored (seconds faster, for its config alone)."""
    _refuse_mixed(args)
    if kind == "checkpoint":
        from oneblock.io import checkpoint

        return checkpoint.load(args.model).eval()
    import torch

    from oneblock.inference.load import load_model

    return load_model(args.model, dtype=torch.float32 if exact else None).model.eval()


def model_and_config(
    args: argparse.Namespace, *, seed: int | None = None, meta: bool = False
) -> tuple[nn.Module, ModelConfig]:
    """``(model, cfg)`` from the file ``--model`` names, or from the preset and the config flags.

    Args:
        args: parsed flags.
        seed: seed ``torch`` before building, so random weights are reproducible.
        meta: build on the meta device (shapes and counts only, no memory, no time); ignored for files.
    """
    import torch

    kind = file_kind(args)
    if kind is not None:
        from oneblock.models.inputs import config_of

        model = _from_file(args, kind)
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
    """The config of the flags, or of the file ``--model`` names (a checkpoint's is read from its header)."""
    kind = file_kind(args)
    if kind == "checkpoint":
        _refuse_mixed(args)
        from oneblock.io import checkpoint

        return checkpoint.read_info(args.model).config
    if kind is not None:
        from oneblock.models.inputs import config_of

        return config_of(_from_file(args, kind, exact=False))
    return config_from_args(args)


def add_context_option(parser: argparse.ArgumentParser) -> None:
    """``--context N``: the positions a GGUF file or Hugging Face directory is loaded for (``load_model(context=)``)."""
    parser.add_argument(
        "--context",
        type=int,
        metavar="N",
        help="positions to run the model for (llama.cpp's --ctx-size; at most and by default the model's): Phi-3's "
        "LongRoPE takes its long factors beyond its original context, its short ones within it",
    )
