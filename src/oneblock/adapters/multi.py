"""Several LoRA adapters on one base model, each row of a batch with its own (as S-LoRA and punica serve them).

Every layer some adapter adapts becomes a ``MultiLoraLinear``: the base product once over every row, then each
adapter's low-rank update computed on the rows that chose it alone and added there::

    y[rows_k] = base(x)[rows_k] + scale_k * B_k (A_k x[rows_k])      for each adapter k present in the batch

Rows that chose the base (index 0), or an adapter that leaves this layer alone, get the base product untouched.
A row's output is computed by the same operations as ``LoraLinear``'s with that adapter alone (the input cast to
float32, ``A`` then ``B``, times the scale, added in float32 and cast back), so it equals its value served alone
up to the rounding of a product over fewer or more rows.

Which adapter each row uses is set before each forward on the model's ``AdapterRows``, shared by all its
layers (the batched decoder's rows, or a prompt's batch of one); the layers read it, nothing is passed through
the model's forward.

Shape notation: B rows, ``in`` and ``out`` the base layer's widths, r an adapter's rank.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from oneblock.errors import ConfigError


class AdapterRows:
    """The adapter of each row of the next forward: 0 for the base, k for the k-th adapter (from 1)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.index: list[int] = []  # per row; empty: every row runs the base
        self.groups: dict[int, Tensor] = {}  # adapter k -> its rows, (n_k,) long, for each k >= 1 present

    def select(self, index: Sequence[int], device: torch.device | str = "cpu") -> None:
        """Set the rows' adapters for the forwards that follow.

        Raises:
            ConfigError: an index outside [0, count].
        """
        wrong = [k for k in index if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.count]
        if wrong:
            raise ConfigError(f"adapter indices must lie in [0, {self.count}] (0: the base); got {wrong[:4]}")
        self.index = list(index)
        self.groups = {}
        for k in sorted(set(self.index) - {0}):
            rows = [i for i, chosen in enumerate(self.index) if chosen == k]
            self.groups[k] = torch.tensor(rows, dtype=torch.long, device=device)


class MultiLoraLinear(nn.Module):
    """A linear-like ``base`` with several adapters beside it, one per row (see the module's docstring).

    Args:
        base: the layer adapted (``nn.Linear``, ``BlockLinear``, an int8 layer ...).
        rows: the model's ``AdapterRows``.
        updates: adapter k -> (A (r_k, in) float32, B (out, r_k) float32, scale), for the adapters that adapt this
            layer.
    """

    def __init__(self, base: nn.Module, rows: AdapterRows, updates: dict[int, tuple[Tensor, Tensor, float]]) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = int(base.in_features), int(base.out_features)  # type: ignore[arg-type]
        self.rows = rows
        self.scales: dict[int, float] = {}
        for k, (a, b, scale) in updates.items():
            if tuple(a.shape[1:]) != (self.in_features,) or tuple(b.shape) != (self.out_features, a.shape[0]):
                raise ConfigError(
                    f"adapter {k}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit a layer of "
                    f"{self.in_features} -> {self.out_features} features"
                )
            self.register_buffer(f"lora_A_{k}", a.detach().float().clone(), persistent=False)
            self.register_buffer(f"lora_B_{k}", b.detach().float().clone(), persistent=False)
            self.scales[k] = float(scale)

    def extra_repr(self) -> str:
        ranks = {k: int(getattr(self, f"lora_A_{k}").shape[0]) for k in self.scales}
        return f"adapters (index: rank)={ranks}"

    def forward(self, x: Tensor) -> Tensor:  # (B, ..., in) -> (B, ..., out)
        y = self.base(x)
        groups = {k: rows for k, rows in self.rows.groups.items() if k in self.scales}
        if not groups:
            return y
        if x.shape[0] != len(self.rows.index):
            raise ConfigError(
                f"adapters were selected for {len(self.rows.index)} rows and this input has {x.shape[0]}; call "
                "AdapterRows.select with one index per row before the forward"
            )
        for k, rows in groups.items():
            a, b = getattr(self, f"lora_A_{k}"), getattr(self, f"lora_B_{k}")
            update = F.linear(F.linear(x.index_select(0, rows).to(a.dtype), a), b) * self.scales[k]
            y = y.index_copy(0, rows, (y.index_select(0, rows) + update).to(y.dtype))
        return y


@dataclass(frozen=True)
class ServedAdapters:
    """The adapters ``load_adapters`` put on a model: ``names[k - 1]`` is adapter k; ``rows`` selects them."""

    names: tuple[str, ...]
    rows: AdapterRows


def load_adapters(
    model: nn.Module, adapters: Sequence[tuple[str, str | os.PathLike[str]]]
) -> ServedAdapters:  # fmt: skip
    """Put several peft LoRA adapters on ``model`` at once, in place, chosen per row (``AdapterRows.select``).

    Each is read as ``load_adapter`` reads it (its checks, its fused query/key/value handling), its tensors are
    kept, and its wrappers taken off again before the next is read; then every layer some adapter adapts is
    wrapped once in a ``MultiLoraLinear`` holding the adapters that adapt it. Every parameter is frozen.

    Args:
        adapters: (name, directory) pairs, adapter k = the k-th (from 1).

    Raises:
        ConfigError: no adapters, a name twice, or a model that already has adapters.
        CheckpointError, ConversionError: an adapter that ``load_adapter`` refuses (named by its directory).
    """
    from oneblock.adapters.apply import lora_modules  # here: a model without adapters never reads their files
    from oneblock.adapters.peft import load_adapter

    names = [name for name, _ in adapters]
    if not names:
        raise ConfigError("load_adapters needs at least one (name, directory) pair")
    if len(set(names)) != len(names):
        raise ConfigError(f"adapter names must differ; got {names}")
    if lora_modules(model):
        raise ConfigError("this model already has LoRA adapters; load the adapters onto a model without any")
    updates: dict[str, dict[int, tuple[Tensor, Tensor, float]]] = {}
    for k, (_, directory) in enumerate(adapters, start=1):
        load_adapter(model, directory)
        for site, module in lora_modules(model).items():
            updates.setdefault(site, {})[k] = (module.lora_A.weight.detach(), module.lora_B.weight.detach(),
                                               module.scale)  # fmt: skip
            _replace(model, site, module.base)
    rows = AdapterRows(len(names))
    for site, held in updates.items():
        try:
            base = model.get_submodule(site)
        except AttributeError:  # a later adapter fused or split the layer an earlier one adapted
            raise ConfigError(
                f"the adapters {[names[k - 1] for k in held]} adapt {site}, which another adapter's layout removes "
                "(query/key/value fused for one and separate for another); serve them from separate servers"
            ) from None
        _replace(model, site, MultiLoraLinear(base, rows, held))
    return ServedAdapters(tuple(names), rows)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
