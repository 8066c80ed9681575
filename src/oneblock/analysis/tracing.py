"""Shape tracing: run a real forward pass with forward hooks on every submodule and record what went in and
what came out.

>>> rows = trace_shapes(block, x)            # x (B, T, C)
>>> [(r.name, r.output_shape) for r in rows][:2]
[('', '(2, 5, 64)'), ('attn_norm', '(2, 5, 64)')]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from oneblock.config import ModelConfig
from oneblock.errors import InputError
from oneblock.layers.state import AttentionState
from oneblock.models.inputs import config_of


@dataclass(frozen=True)
class TraceRow:
    """One module call.

    Attributes:
        name: dotted module name relative to the traced root (``""`` for the root itself).
        kind: class name, e.g. ``"MultiHeadAttention"``.
        depth: how many traced calls were in progress around this one (0 for the outermost).
        inputs: shapes of the tensor arguments, positional then keyword, e.g. ``[(2, 5, 64)]``.
        outputs: shapes of the tensors returned, in order.
        parameters: parameters of the module and its children (tied matrices once).
    """

    name: str
    kind: str
    depth: int
    inputs: list[tuple[int, ...]]
    outputs: list[tuple[int, ...]]
    parameters: int

    @property
    def input_shape(self) -> str:
        return format_shapes(self.inputs)

    @property
    def output_shape(self) -> str:
        return format_shapes(self.outputs)

    def as_dict(self) -> dict[str, Any]:
        return {
            "module": self.name,
            "kind": self.kind,
            "depth": self.depth,
            "inputs": [list(s) for s in self.inputs],
            "outputs": [list(s) for s in self.outputs],
            "parameters": self.parameters,
        }


def _shapes(value: Any, reads: tuple[str, ...] | None = None) -> list[tuple[int, ...] | None]:
    """Shapes of the tensors in a (nested) value, in order; ``None`` stands for a ``None`` result.

    Of an ``AttentionState`` only the tensors in the fields ``reads`` count (all when ``None``): a cross-attention
    layer shows the memory it attends to, a self-attention layer does not.
    """
    if isinstance(value, Tensor):
        return [tuple(value.shape)]
    if value is None:
        return [None]
    if isinstance(value, AttentionState):
        return [tuple(t.shape) for t in value.tensors(reads)]
    if isinstance(value, (tuple, list)):
        return [s for item in value for s in _shapes(item, reads)]
    if isinstance(value, dict):
        return [s for item in value.values() for s in _shapes(item, reads)]
    return []


def format_shapes(shapes: Iterable[tuple[int, ...]]) -> str:
    """``(2, 5, 64), (2, 7, 64)``."""
    parts = ["(" + ", ".join(map(str, s)) + ("," if len(s) == 1 else "") + ")" for s in shapes]
    return ", ".join(parts) if parts else "-"


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def trace_shapes(root: nn.Module, call: Callable[[], Any], *, max_depth: int | None = None) -> list[TraceRow]:
    """Run ``call()`` (a forward pass that goes through ``root``) and record every call of ``root``'s modules.

    Rows are in call order (a parent before its children); a module called twice (a tied head, a shared table)
    gives two rows.

    Args:
        root: the module whose submodules are traced; its own call is the first row.
        call: a zero-argument function running the forward pass, e.g. ``lambda: model(tokens)``.
        max_depth: leave out calls nested deeper than this (``root``'s own call is depth 0).

    Returns:
        One ``TraceRow`` per call.
    """
    names: dict[int, list[str]] = {}
    modules: dict[int, nn.Module] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        if isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Dropout)):
            continue  # containers are never called; dropout is the identity at inference
        names.setdefault(id(module), []).append(name)
        modules[id(module)] = module

    slots: list[dict[str, Any]] = []
    stack: list[int] = []  # indices of the calls in progress, innermost last

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        # A shared module (one token table under two stacks) is named after the caller in progress.
        candidates = names[id(module)]
        parent = slots[stack[-1]]["name"] if stack else None
        name = next((n for n in candidates if parent is not None and _parent(n) == parent), candidates[0])
        slots.append(
            {
                "name": name,
                "module": module,
                "depth": len(stack),
                "inputs": _shapes([args, kwargs], getattr(module, "state_fields", None)),
                "outputs": [],
            }
        )
        stack.append(len(slots) - 1)

    def post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        slots[stack.pop()]["outputs"] = _shapes(output)

    handles = []
    for module in modules.values():
        handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(module.register_forward_hook(post_hook, with_kwargs=True))
    try:
        with torch.no_grad():
            call()
    finally:
        for handle in handles:
            handle.remove()
    return [
        TraceRow(
            name=slot["name"],
            kind=type(slot["module"]).__name__,
            depth=slot["depth"],
            inputs=[s for s in slot["inputs"] if s is not None],
            outputs=[s for s in slot["outputs"] if s is not None],
            parameters=_numel(slot["module"]),
        )
        for slot in slots
        if max_depth is None or slot["depth"] <= max_depth
    ]


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def example_tokens(cfg: ModelConfig, batch: int, seq_len: int, *, seed: int = 0) -> Tensor:
    """Random token ids (B, T) in ``[0, vocab_size)`` from a seeded generator."""
    if batch <= 0 or seq_len <= 0:
        raise InputError(f"batch and seq_len must be positive; got batch={batch}, seq_len={seq_len}")
    if seq_len > cfg.max_seq_len:
        raise InputError(f"seq_len ({seq_len}) exceeds max_seq_len ({cfg.max_seq_len}); pass a shorter seq_len")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=generator)


def forward_call(
    model: nn.Module, batch: int, seq_len: int, *, src_len: int | None = None, seed: int = 0
) -> Callable[[], Any]:
    """A zero-argument forward pass of ``model`` on random tokens.

    ``model(tokens)``, or ``model(src, tgt)`` for an encoder-decoder (source length ``src_len``, default
    ``seq_len``).
    """
    cfg = config_of(model)
    device = next(model.parameters()).device
    tokens = example_tokens(cfg, batch, seq_len, seed=seed).to(device)
    if cfg.arch == "encoder-decoder":
        src = example_tokens(cfg, batch, src_len or seq_len, seed=seed + 1).to(device)
        return lambda: model(src, tokens)
    return lambda: model(tokens)
