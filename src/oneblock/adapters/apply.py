"""Applying LoRA adapters to a model, merging them into its weights and taking them out again.

Which layers a target name selects is :mod:`oneblock.adapters.targets`; the adapter module itself is
:class:`oneblock.adapters.lora.LoraLinear`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn

from oneblock.adapters.lora import LoraConfig, LoraLinear
from oneblock.adapters.targets import prepare_sites, unfuse_after_unload
from oneblock.errors import ConfigError


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    """Every ``LoraLinear`` in ``model``, by module name (``blocks.0.attn.q_proj``)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLinear)}


def apply_lora(model: nn.Module, cfg: LoraConfig, *, limit_rank: bool = True) -> nn.Module:
    """Wrap the layers ``cfg.targets`` names in ``LoraLinear``s, in place; freeze every other parameter.

    The adapters are the only parameters left with ``requires_grad``, so a trainer that trains what
    ``requires_grad`` says trains them alone. Which layers a name selects, per family, is
    ``oneblock.adapters.targets``; a GPT-2's query, key and value become one fused projection first (its
    ``c_attn``, where peft puts one adapter for the three).

    Args:
        limit_rank: refuse a rank above a layer's width (``B A`` has rank at most ``min(in, out)``, so more only
            costs memory); ``False`` for an adapter read from a file, which peft may have made so.

    Returns:
        ``model``.

    Raises:
        ConfigError: ``cfg`` is not a ``LoraConfig``, the model already has adapters, a target is unknown, or
            the rank is above a target layer's width.
    """
    if not isinstance(cfg, LoraConfig):
        raise ConfigError(f"apply_lora expects a LoraConfig; got {type(cfg).__name__}")
    if lora_modules(model):
        raise ConfigError("this model already has LoRA adapters; merge_lora(model, unload=True) them first")
    names = prepare_sites(model, cfg.targets)
    if limit_rank:
        _check_rank(model, names, cfg.rank)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        base = getattr(owner, child)
        setattr(owner, child, LoraLinear(base, rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout, rslora=cfg.rslora))
    return model


def _check_rank(model: nn.Module, names: list[str], rank: int) -> None:
    """Refuse a rank above the narrowest target layer's width, before any adapter is allocated."""
    widths = {}
    for name in names:
        layer = model.get_submodule(name)
        n_in, n_out = getattr(layer, "in_features", None), getattr(layer, "out_features", None)
        if isinstance(n_in, int) and isinstance(n_out, int):  # else LoraLinear says what it needs
            widths[name] = (n_in, n_out)
    if not widths:
        return
    name, (n_in, n_out) = min(widths.items(), key=lambda item: min(item[1]))
    if rank > min(n_in, n_out):
        raise ConfigError(
            f"LoRA rank {rank} is above the width of layer {name!r} ({n_in} in, {n_out} out): an update B A of "
            f"it has rank at most {min(n_in, n_out)}; choose a LoRA rank of at most {min(n_in, n_out)}"
        )


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` as its base inside the block: every unmerged adapter adds nothing (peft's ``disable_adapter``).

    The base model without a second copy in memory, as DPO's frozen reference needs it.

    Raises:
        ConfigError: an adapter is merged (its update is inside the weight and cannot be switched off).
    """
    modules = list(lora_modules(model).values())
    if any(m.merged for m in modules):
        raise ConfigError("cannot disable merged LoRA adapters; unmerge_lora(model) first")
    for module in modules:
        module.disabled = True
    try:
        yield model
    finally:
        for module in modules:
            module.disabled = False


def adapter_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapters' tensors only, under oneblock names: ``blocks.0.attn.q_proj.lora_A.weight`` (r, in) ..."""
    out: dict[str, Tensor] = {}
    for name, module in lora_modules(model).items():
        out[f"{name}.lora_A.weight"] = module.lora_A.weight
        out[f"{name}.lora_B.weight"] = module.lora_B.weight
    return out


def merge_lora(model: nn.Module, *, unload: bool = False) -> nn.Module:
    """Merge every adapter into its base weight (``LoraLinear.merge``), in place.

    Args:
        unload: also replace each wrapper by its base layer, keeping no copy of the old weights (peft's
            ``merge_and_unload``): the model is then a plain oneblock model again, whose state dict, checkpoint
            and Hugging Face export are those of any other; a GPT-2 query/key/value fused for its adapter is split
            back into three projections.

    Returns:
        ``model``.

    Raises:
        ConfigError: a merged weight would hold NaN or inf (peft's ``safe_merge``), naming the layer; the layers
            merged before it stay merged, that one and those after it do not.
    """
    for name, module in lora_modules(model).items():
        if not module.merged:
            try:
                module.merge(keep_original=not unload)
            except ConfigError as error:
                raise type(error)(f"{name}: {error}") from None
        if unload:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.base)
    if unload:
        unfuse_after_unload(model)
    return model


def unmerge_lora(model: nn.Module) -> nn.Module:
    """Undo ``merge_lora`` (without ``unload``): every base weight exactly as before. Returns ``model``."""
    for module in lora_modules(model).values():
        if module.merged:
            module.unmerge()
    return model
