"""The tiled cross-entropy of an LM head against ``F.cross_entropy(F.linear(h, W, b), y)``: losses, gradients of
the hidden states and of a trained head weight, ignored rows, 4-bit heads, autocast, and the size of what it
computes at once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from oneblock.errors import InputError
from oneblock.layers import chunked_ce
from oneblock.layers.chunked_ce import IGNORE_INDEX, chunked_cross_entropy, per_row_gradients, predictions
from oneblock.layers.quantized import BlockLinear

N, C, V = 41, 13, 103  # distinct odd sizes: a transposed tile cannot keep the shape


def case(dtype=torch.float64, *, seed=0, ignored=True, trained=True):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, C, generator=gen, dtype=dtype).requires_grad_()
    w = torch.randn(V, C, generator=gen, dtype=dtype).requires_grad_(trained)
    b = torch.randn(V, generator=gen, dtype=dtype)
    y = torch.randint(0, V, (N,), generator=gen)
    if ignored:
        y[::4] = IGNORE_INDEX
    return h, w, b, y


def grads(loss, inputs):
    upstream = torch.randn(loss.shape, generator=torch.Generator().manual_seed(9), dtype=loss.dtype)
    return torch.autograd.grad((loss * upstream).sum(), inputs)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("chunk_values", [1, 97, 10_000])  # one word per tile, tiles across the words, one tile
@pytest.mark.parametrize("trained", [True, False], ids=["trained-head", "frozen-head"])
def test_float64_losses_and_gradients_equal_f_cross_entropy(reduction, chunk_values, trained):
    """A trained head takes the backward pass that computes the logits again; a frozen one the hidden states'
    gradient gathered in the forward pass (an online softmax across the tiles): both are exact."""
    h, w, b, y = case(trained=trained)
    inputs = [h, w] if trained else [h]
    want = F.cross_entropy(F.linear(h, w, b), y, ignore_index=IGNORE_INDEX, reduction=reduction)
    got = chunked_cross_entropy(h, y, w, b, reduction=reduction, chunk_values=chunk_values)
    assert got.dtype == torch.float64 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    for g, r in zip(grads(got, inputs), grads(want, inputs), strict=True):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=0)


@pytest.mark.parametrize("trained", [True, False], ids=["trained-head", "frozen-head"])
def test_rows_beyond_one_row_chunk_are_tiled_too(monkeypatch, trained):
    monkeypatch.setattr(chunked_ce, "ROW_CHUNK", 7)  # 31 kept rows: 5 chunks of rows, each across the words
    monkeypatch.setattr(chunked_ce, "WEIGHT_TILE_VALUES", 13 * 11)  # and slices of 11 words
    h, w, b, y = case(trained=trained)
    inputs = [h, w] if trained else [h]
    want = F.cross_entropy(F.linear(h, w, b), y, reduction="none")
    got = chunked_cross_entropy(h, y, w, b)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    for g, r in zip(grads(got, inputs), grads(want, inputs), strict=True):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=0)


@pytest.mark.parametrize("trained", [True, False], ids=["trained-head", "frozen-head"])
def test_float32_within_float32_tolerances(trained):
    """Float32, the project's float32 tolerances (atol 1e-5, rtol 1.3e-6) on the losses and on the gradients (of
    scale ~5 here: the logits of unit weights over 13 features are ~N(0, 13))."""
    h, w, b, y = case(torch.float32, trained=trained)
    inputs = [h, w] if trained else [h]
    want = F.cross_entropy(F.linear(h, w, b), y, reduction="none")
    got = chunked_cross_entropy(h, y, w, b, chunk_values=200)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1.3e-6)
    for g, r in zip(grads(got, inputs), grads(want, inputs), strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1.3e-6)


@pytest.mark.parametrize("chunk_values", [V, 5 * V, 10_000])  # a row at a time, chunks of 5 rows, every row
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_a_trained_head_under_one_incoming_gradient_is_exact_from_its_one_pass(chunk_values, reduction):
    """A sum or a mean gives every row the same incoming gradient: the forward pass computed both gradients and
    the backward pass scaled them; ``per_row_gradients`` takes the pass that computes the logits again."""
    h, w, b, y = case()
    want = F.cross_entropy(F.linear(h, w, b), y, ignore_index=IGNORE_INDEX, reduction=reduction)
    ref = torch.autograd.grad(want * 3.0, [h, w])
    got = chunked_cross_entropy(h, y, w, b, reduction=reduction, chunk_values=chunk_values)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    for g, r in zip(torch.autograd.grad(got * 3.0, [h, w]), ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=0)
    with per_row_gradients():
        again = chunked_cross_entropy(h, y, w, b, reduction=reduction, chunk_values=chunk_values)
    for g, r in zip(torch.autograd.grad(again * 3.0, [h, w]), ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=0)


def test_a_second_backward_pass_of_a_trained_head_computes_the_logits_again():
    """The gradients gathered in the forward pass serve one backward pass; a retained graph's next one (here with
    incoming gradients that differ by row) computes the logits again and is exact too."""
    h, w, b, y = case()
    got = chunked_cross_entropy(h, y, w, b, chunk_values=5 * V)
    want = F.cross_entropy(F.linear(h, w, b), y, reduction="none")
    first = torch.autograd.grad(got.sum(), [h, w], retain_graph=True)
    for g, r in zip(first, torch.autograd.grad(want.sum(), [h, w], retain_graph=True), strict=True):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=0)
    for g, r in zip(grads(got, [h, w]), grads(want, [h, w]), strict=True):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=0)


def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_theirs():
    h, w, b, y = case(trained=False)
    got = chunked_cross_entropy(h, y, w, b, reduction="sum", chunk_values=300)
    got.backward()
    assert w.grad is None
    h_ref = h.detach().clone().requires_grad_()
    F.cross_entropy(F.linear(h_ref, w, b), y, reduction="sum").backward()
    torch.testing.assert_close(h.grad, h_ref.grad, atol=1e-10, rtol=0)


def test_ignored_rows_have_zero_loss_and_zero_gradient():
    h, w, b, y = case()
    losses = chunked_cross_entropy(h, y, w, b)
    ignored = y == IGNORE_INDEX
    assert torch.equal(losses[ignored], torch.zeros(int(ignored.sum()), dtype=torch.float64))
    (dh,) = torch.autograd.grad(losses.sum(), [h])
    assert torch.equal(dh[ignored], torch.zeros_like(dh[ignored]))
    assert (dh[~ignored].abs().sum(dim=1) > 0).all()


def test_every_row_ignored_matches_f_cross_entropy_zeros_and_nan():
    h, w, b, _ = case()
    y = torch.full((N,), IGNORE_INDEX)
    assert torch.equal(chunked_cross_entropy(h, y, w, b), torch.zeros(N, dtype=torch.float64))
    assert chunked_cross_entropy(h, y, w, b, reduction="mean").isnan()
    assert F.cross_entropy(F.linear(h, w, b), y, reduction="mean").isnan()
    (dh,) = torch.autograd.grad(chunked_cross_entropy(h, y, w, b, reduction="sum"), [h])
    assert torch.equal(dh, torch.zeros_like(dh))


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_a_4bit_head_equals_the_float_head_of_its_exact_weights(fmt):
    """A ``BlockLinear`` head hands out decoded tiles of rows: the losses and the hidden states' gradients are
    those of its exact dequantized weight (float64 here; the tiles are exact float32 values)."""
    gen = torch.Generator().manual_seed(3)
    head = BlockLinear.from_float(torch.randn(112, 64, generator=gen), fmt)
    h = torch.randn(N, 64, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 112, (N,), generator=gen)
    y[1::5] = IGNORE_INDEX
    got = chunked_cross_entropy(h, y, head, chunk_values=41 * 16)
    want = F.cross_entropy(F.linear(h, head.dequantized().double()), y, reduction="none")
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    torch.testing.assert_close(grads(got, [h])[0], grads(want, [h])[0], atol=1e-10, rtol=0)


@pytest.mark.parametrize("trained", [True, False], ids=["trained-head", "frozen-head"])
def test_under_bf16_autocast_it_follows_the_autocast_logits(trained):
    """Under autocast the head's product is bfloat16 as ``F.linear``'s is, the softmax float32: within bf16's
    rounding of the reference that takes the same bf16 logits."""
    h, w, b, y = case(torch.float32, trained=trained)
    inputs = [h, w] if trained else [h]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunked_cross_entropy(h, y, w, b, chunk_values=300)
        want = F.cross_entropy(F.linear(h, w, b).float(), y, reduction="none")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)
    for g, r in zip(grads(got, inputs), grads(want, inputs), strict=True):
        torch.testing.assert_close(g, r, atol=5e-2, rtol=2e-2)


class _Largest(TorchDispatchMode):
    """Records the most elements of any tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("trained", [True, False], ids=["trained-head", "frozen-head"])
def test_it_never_computes_the_whole_logits_at_once(trained):
    """Forward and backward, no op returns more than ``chunk_values`` logits (nor the (V, C) weight gradient)
    while ``F.cross_entropy`` holds all N x V."""
    gen = torch.Generator().manual_seed(0)
    n, c, v = 64, 8, 1000
    h = torch.randn(n, c, generator=gen, requires_grad=True)
    w = torch.randn(v, c, generator=gen, requires_grad=trained)
    y = torch.randint(0, v, (n,), generator=gen)
    with _Largest() as ours:
        chunked_cross_entropy(h, y, w, reduction="sum", chunk_values=4096).backward()  # a trained head: one pass
    assert ours.largest <= max(4096, v * c)
    with _Largest() as ours, per_row_gradients():
        chunked_cross_entropy(h, y, w, reduction="sum", chunk_values=4096).backward()  # the logits again
    assert ours.largest <= max(4096, v * c)
    with _Largest() as plain:
        F.cross_entropy(F.linear(h, w), y, reduction="sum").backward()
    assert plain.largest == n * v


@pytest.mark.parametrize("chunk_values", [1, 97, 10_000])
@pytest.mark.parametrize("grad", [False, True])
def test_predictions_are_the_argmax_of_the_whole_logits(chunk_values, grad):
    """Every row's most likely word, found slice by slice, is ``argmax`` of the whole logits; ignored rows get -1;
    each call appends its own; the losses are those of a call without the context."""
    h, w, b, y = case()
    with torch.set_grad_enabled(grad), predictions() as found:
        got = chunked_cross_entropy(h, y, w, b, chunk_values=chunk_values)
        chunked_cross_entropy(h[:5], torch.arange(5), w, b, chunk_values=chunk_values)  # a second call
    logits = F.linear(h, w, b)
    want = torch.where(y == IGNORE_INDEX, -1, logits.argmax(-1))
    assert len(found) == 2 and torch.equal(found[0], want)
    assert torch.equal(found[1], logits[:5].argmax(-1))
    torch.testing.assert_close(got, F.cross_entropy(logits, y, reduction="none"), atol=1e-10, rtol=0)


def test_predictions_with_ties_at_the_maximum_take_the_first_word():
    h = torch.ones(3, 4, dtype=torch.float64)
    w = torch.zeros(10, 4, dtype=torch.float64)
    w[[2, 5, 9]] = 1.0  # words 2, 5 and 9 tie at the maximum, in three slices of 3 words (9 logits a tile)
    with predictions() as found:
        chunked_cross_entropy(h, torch.tensor([0, 5, IGNORE_INDEX]), w, chunk_values=9)
    assert found[0].tolist() == [2, 2, -1]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"targets": torch.full((N,), V)}, r"target id 103 is outside the vocabulary \[0, 103\)"),
        ({"targets": torch.full((N,), -2)}, r"target id -2 is outside"),
        ({"targets": torch.zeros(N, 2, dtype=torch.long)}, r"targets \(N,\)"),
        ({"targets": torch.zeros(N)}, "integer ids"),
        ({"reduction": "avg"}, "reduction must be one of none, sum, mean"),
        ({"chunk_values": 0}, "chunk_values must be a positive integer"),
        ({"bias": torch.zeros(V + 1)}, r"bias must have shape \(103,\)"),
    ],
)
def test_bad_inputs_are_refused_by_name(kwargs, match):
    h, w, b, y = case()
    args = {"targets": y, "bias": b, **kwargs}
    targets, bias = args.pop("targets"), args.pop("bias")
    with pytest.raises(InputError, match=match):
        chunked_cross_entropy(h, targets, w, bias, **args)


def test_hidden_of_the_wrong_width_is_refused():
    h, w, b, y = case()
    with pytest.raises(InputError, match=r"hidden \(N, 13\)"):
        chunked_cross_entropy(h[:, :5], y, w, b)
