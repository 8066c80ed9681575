"""Low-rank adapters (LoRA; Hu et al., 2021) exactly as peft defines them.

A ``LoraLinear`` wraps one linear-like layer ``base`` (an ``nn.Linear``, or any module with ``in_features`` and
``out_features`` whose forward is differentiable in its input, such as a 4-bit layer) and adds a rank-``r``
update beside it::

    y = base(x) + scale * B(A(dropout(x))),   scale = alpha / r   (rsLoRA: alpha / sqrt(r))

A (r, in) starts Kaiming-uniform (a = sqrt(5)) and B (out, r) at zeros, so an untrained adapter changes nothing.
Both are float32 whatever the base's dtype: the input is cast to float32 for the adapter and the update cast
back, as peft does. ``merge`` folds ``scale * B A`` (computed in float32) into a float base weight; ``unmerge``
puts back the weight as it was, bit for bit.

Shape notation: B batch, T length, r rank; ``in`` and ``out`` the base layer's widths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from oneblock.errors import ConfigError
from oneblock.layers.lowrank import LowRankParts, has_hooks, lowrank_linears, parts_of

DEFAULT_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoraConfig:
    """What adapters to build.

    Attributes:
        rank: ``r >= 1``, the inner width of ``B A``.
        alpha: the numerator of the scale (> 0).
        dropout: dropout on the adapter's input while training, in [0, 1).
        rslora: scale by ``alpha / sqrt(r)`` (Kalajdzievski, 2023) instead of ``alpha / r``.
        targets: which linear layers get adapters: the short names ``q, k, v, o, gate, up, down`` (every family's
            query, key, value and output projections and feed-forward layers), Hugging Face module names of the
            family (``q_proj``, ``c_attn``, ``attn.c_proj``, ...), or ``("all-linear",)``: every linear layer but
            the embedding and the head. See ``oneblock.adapters.targets``.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    rslora: bool = False
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"LoRA rank must be an integer >= 1; got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 < self.alpha < math.inf:
            raise ConfigError(f"LoRA alpha must be a finite number > 0; got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ConfigError(f"LoRA dropout must lie in [0, 1); got {self.dropout!r}")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        if not targets or not all(isinstance(t, str) and t.strip() for t in targets):
            raise ConfigError(
                f"LoRA targets must be non-empty names such as {','.join(DEFAULT_TARGETS)} or all-linear; "
                f"got {self.targets!r}"
            )
        targets = tuple(t.strip() for t in targets)
        if ALL_LINEAR in targets and len(targets) > 1:
            raise ConfigError(f"LoRA target {ALL_LINEAR!r} already means every linear layer; got {targets}")
        object.__setattr__(self, "targets", targets)
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "dropout", float(self.dropout))

    @property
    def scale(self) -> float:
        """The factor on ``B A``: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
        return self.alpha / math.sqrt(self.rank) if self.rslora else self.alpha / self.rank


class LoraLinear(nn.Module):
    """``y = base(x) + scale * B(A(dropout(x)))`` around one linear-like ``base`` (its parameters untouched).

    Args:
        base: the wrapped layer; needs ``in_features`` and ``out_features``.
        rank, alpha, dropout, rslora: as in ``LoraConfig``.

    Shape: (..., in) -> (..., out).
    """

    def __init__(self, base: nn.Module, *, rank: int, alpha: float, dropout: float = 0.0, rslora: bool = False):
        super().__init__()
        cfg = LoraConfig(rank=rank, alpha=alpha, dropout=dropout, rslora=rslora)  # validates
        in_features, out_features = getattr(base, "in_features", None), getattr(base, "out_features", None)
        if not isinstance(in_features, int) or not isinstance(out_features, int):
            raise ConfigError(
                f"LoRA wraps linear layers with integer in_features and out_features; {type(base).__name__} has "
                f"in_features={in_features!r}, out_features={out_features!r}"
            )
        device = _device_of(base)
        self.base = base
        self.in_features, self.out_features = in_features, out_features
        self.rank, self.alpha, self.scale = cfg.rank, cfg.alpha, cfg.scale
        self.lora_dropout: nn.Module = nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()
        self.lora_A = nn.Linear(in_features, cfg.rank, bias=False, device=device, dtype=torch.float32)  # (r, in)
        self.lora_B = nn.Linear(cfg.rank, out_features, bias=False, device=device, dtype=torch.float32)  # (out, r)
        self.reset_adapter()
        self.merged = False
        self.disabled = False  # ``adapters_disabled``: the base layer alone (DPO's reference model)
        self._unmerged_weight: Tensor | None = None  # the base weight as it was before ``merge``

    def reset_adapter(self) -> None:
        """peft's initialization: A Kaiming-uniform with a = sqrt(5), B zeros (so the update starts at zero)."""
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def extra_repr(self) -> str:
        merged = ", merged" if self.merged else ""
        return f"rank={self.rank}, alpha={self.alpha:g}, scale={self.scale:g}{merged}"

    def forward(self, x: Tensor) -> Tensor:
        parts = parts_of([self], x)
        if parts is not None:
            return lowrank_linears(parts, x)[0]  # base and update as one node
        y = self.base(x)  # (..., out)
        if self.merged or self.disabled:
            return y
        dtype = self.lora_A.weight.dtype
        update = self.lora_B(self.lora_A(self.lora_dropout(x.to(dtype)))) * self.scale  # (..., r) -> (..., out)
        return (y + update).to(y.dtype)

    def lowrank_parts(self) -> LowRankParts | None:
        """The tensors of ``forward`` for ``oneblock.layers.lowrank`` to compute it as one node with its neighbours:
        ``None`` unless the adapter is active, the base a plain ``nn.Linear`` of the adapter's dtype without
        hooks, and dropout off."""
        dropout = self.lora_dropout
        if self.merged or self.disabled or (isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0):
            return None
        base, a, b = self.base, self.lora_A, self.lora_B
        if type(base) is not nn.Linear or has_hooks(base) or has_hooks(a) or has_hooks(b):
            return None
        if base.weight.dtype != a.weight.dtype:
            return None
        return LowRankParts(base.weight, base.bias, a.weight, b.weight, self.scale)

    def delta_weight(self) -> Tensor:
        """``scale * B A``: the (out, in) float32 matrix the adapter adds to the base weight."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scale

    def merge(self, *, keep_original: bool = True) -> None:
        """Fold the update into the base weight: ``W += scale B A``, summed in float32, stored in W's dtype.

        Args:
            keep_original: keep a copy of W so that ``unmerge`` restores it bit for bit (one matrix of memory).

        Raises:
            ConfigError: the base holds no floating-point ``weight`` (a 4-bit layer), is already merged, or the
                merged weight would hold NaN or inf (then nothing changes).
        """
        if self.merged:
            raise ConfigError("this LoRA layer is already merged; unmerge it first")
        weight = self._base_weight("merge")
        with torch.no_grad():
            merged = (weight.float() + self.delta_weight().to(weight.device)).to(weight.dtype)  # (out, in)
            bad = int((~torch.isfinite(merged)).sum())
            if bad:  # peft's safe_merge: a NaN or inf weight would poison every output it touches
                raise ConfigError(
                    f"merging this LoRA adapter gives {bad} non-finite (NaN or inf) values in the "
                    f"({self.out_features}, {self.in_features}) {weight.dtype} weight; the weight is left as it "
                    "was. Check the adapter's tensors for NaN or inf, or merge in float32 if the sum overflows"
                )
            self._unmerged_weight = weight.detach().clone() if keep_original else None
            weight.copy_(merged)
        self.merged = True

    def unmerge(self) -> None:
        """Undo ``merge``: the base weight becomes exactly what it was.

        Raises:
            ConfigError: not merged, or merged with ``keep_original=False``.
        """
        if not self.merged:
            raise ConfigError("this LoRA layer is not merged; there is nothing to unmerge")
        if self._unmerged_weight is None:
            raise ConfigError("this LoRA layer was merged with keep_original=False, so its weight cannot be restored")
        weight = self._base_weight("unmerge")
        with torch.no_grad():
            weight.copy_(self._unmerged_weight)
        self._unmerged_weight = None
        self.merged = False

    def _base_weight(self, action: str) -> Tensor:
        weight = getattr(self.base, "weight", None)
        if not isinstance(weight, Tensor) or not weight.is_floating_point():
            raise ConfigError(
                f"cannot {action} a LoRA adapter into a {type(self.base).__name__}: it holds no floating-point "
                "weight (a quantized layer); keep the adapter unmerged, or load the base in float32 to merge"
            )
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ConfigError(
                f"cannot {action}: the base weight has shape {tuple(weight.shape)}, expected "
                f"(out, in) = ({self.out_features}, {self.in_features})"
            )
        return weight


def _device_of(module: nn.Module) -> torch.device:
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")
