"""Frozen linear layers with low-rank updates as one autograd node: equal to the modules they stand for."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from oneblock.adapters.lora import LoraLinear
from oneblock.layers.lowrank import LowRankParts, lowrank_linears, parts_of, project_all


def _parts(*, dtype: torch.dtype = torch.float64, requires_grad: bool = True) -> list[LowRankParts]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for n, r, bias, scale in ((4, 2, True, 0.7), (3, 1, False, 2.0), (6, 3, True, 1.5)):

        def t(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(requires_grad)

        out.append(LowRankParts(t(n, 5), t(n) if bias else None, t(r, 5), t(n, r), scale))
    return out


def _flat(parts: list[LowRankParts]) -> list[torch.Tensor]:
    return [t for p in parts for t in (p.weight, p.bias, p.lora_A, p.lora_B) if t is not None]


def test_gradients_of_every_input_pass_gradcheck():
    parts = _parts()
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    scales = [p.scale for p in parts]

    def run(x, *flat):
        it = iter(flat)
        rebuilt = []
        for p, s in zip(parts, scales, strict=True):
            w, b = next(it), next(it) if p.bias is not None else None
            rebuilt.append(LowRankParts(w, b, next(it), next(it), s))
        return tuple(lowrank_linears(rebuilt, x))

    assert torch.autograd.gradcheck(run, (x, *_flat(parts)))


def test_values_are_the_formula():
    parts = _parts(requires_grad=False)
    x = torch.randn(4, 5, dtype=torch.float64)
    for y, p in zip(lowrank_linears(parts, x), parts, strict=True):
        expected = x @ p.weight.T + (0 if p.bias is None else p.bias) + p.scale * (x @ p.lora_A.T) @ p.lora_B.T
        torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


def _adapted(widths=(8, 12), bias=True) -> list[LoraLinear]:
    torch.manual_seed(0)
    layers = [LoraLinear(nn.Linear(16, n, bias=bias), rank=4, alpha=8) for n in widths]
    for layer in layers:
        nn.init.normal_(layer.lora_B.weight)
        layer.base.requires_grad_(False)
    return layers


def _run(layers, x, *, fused: bool, monkeypatch):
    if not fused:
        monkeypatch.setattr(LoraLinear, "lowrank_parts", lambda self: None)
    x = x.clone().requires_grad_()
    ys = project_all(layers, x)
    sum((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum() for y in ys).backward()
    grads = [t.grad.clone() for layer in layers for t in (layer.lora_A.weight, layer.lora_B.weight)]
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    monkeypatch.undo()
    return ys, x.grad, grads


@pytest.mark.parametrize("bias", [False, True])
def test_a_group_equals_its_modules(bias, monkeypatch):
    """Outputs bit for bit (the same operations in peft's order); gradients within float32 rounding."""
    layers = _adapted(bias=bias)
    x = torch.randn(3, 7, 16)
    ys, gx, grads = _run(layers, x, fused=True, monkeypatch=monkeypatch)
    assert all(type(y.grad_fn).__name__ == "_LowRankLinearsBackward" for y in ys)
    ys_ref, gx_ref, grads_ref = _run(layers, x, fused=False, monkeypatch=monkeypatch)
    assert all(type(y.grad_fn).__name__ != "_LowRankLinearsBackward" for y in ys_ref)
    for y, y_ref in zip(ys, ys_ref, strict=True):
        assert torch.equal(y, y_ref)
    torch.testing.assert_close(gx, gx_ref, rtol=1.3e-6, atol=1e-6)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=1.3e-6, atol=1e-6)
    assert all(layer.base.weight.grad is None for layer in layers)  # the frozen weights get none


def test_a_single_layer_takes_the_same_path():
    (layer,) = _adapted(widths=(8,))
    y = layer(torch.randn(2, 16, requires_grad=True))
    assert type(y.grad_fn).__name__ == "_LowRankLinearsBackward"


def _offers(layer: LoraLinear, x: torch.Tensor) -> bool:
    return type(project_all([layer], x)[0].grad_fn).__name__ == "_LowRankLinearsBackward"


def test_the_modules_run_where_the_parts_do_not_say_everything():
    x = torch.randn(2, 16, requires_grad=True)
    merged, disabled, dropped, hooked, half = (_adapted(widths=(8,))[0] for _ in range(5))
    merged.merge()
    disabled.disabled = True
    dropped.lora_dropout = nn.Dropout(0.1)
    hooked.base.register_forward_hook(lambda module, args, out: None)
    half.base.to(torch.bfloat16)
    for layer in (merged, disabled, dropped, hooked, half):
        assert layer.lowrank_parts() is None
    dropped.eval()
    assert dropped.lowrank_parts() is not None and _offers(dropped, x)  # eval: dropout is the identity
    plain = _adapted(widths=(8,))[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not _offers(plain, x)  # autocast decides each product's dtype itself
    assert parts_of([plain], x.double()) is None  # an input of another dtype: the modules' own error or result
    assert project_all([plain, nn.Linear(16, 3)], x)[1].shape == (2, 3)  # a plain layer in the group: modules
