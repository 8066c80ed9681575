"""The native decode step computes what the Python step (``LeanDecode.step``, the reference) computes.

Float32 weights: logits within 1e-5 of the logits' scale and identical greedy tokens, for one row, a left-padded
batch of different lengths and the batched decoder's staggered slots. Block weights, where 8-bit activations make
any two summation orders differ by a flipped rounding now and then: the native step is as faithful to the float32
model as the Python step (mean KL divergence, fed token by token, within 10%).
"""

from __future__ import annotations

import copy

import pytest
import torch
from native_testing import (
    FAMILIES,
    WIDE,
    WIDE_FAMILIES,
    build,
    decode_across_threads_and_isas,
    decode_both,
    kl_to,
    relative,
)

import oneblock as ob
from oneblock import kernels
from oneblock.inference.batch import BatchDecoder
from oneblock.inference.decode import LeanDecode
from oneblock.inference.generation import generate
from oneblock.inference.native_step import ENV, NativeStep
from oneblock.inference.request import prepare

pytestmark = pytest.mark.skipif(kernels.backend() == "torch", reason="the native step needs the C++ library")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prompts", [[[5, 17, 3, 99, 42]], [[5, 17, 3, 99, 42], [7, 8], [60, 61, 62]]])
def test_native_logits_equal_the_python_step(family, prompts):
    native, python = decode_both(build(family), prompts, steps=12)
    assert native.dtype == python.dtype == torch.float32
    assert relative(native, python) <= 1e-5
    assert torch.equal(native.argmax(-1), python.argmax(-1))


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_takes_the_native_step_and_matches_the_uncached_path(family):
    model = build(family, seed=1)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6], [0, 0, 0, 2, 7, 1, 8, 2]])
    mask = prompt != 0
    run = prepare(model, prompt, 16, False, None, None, mask, None)
    assert LeanDecode(run).native is not None
    fast = generate(model, prompt, 16, greedy=True, prompt_padding_mask=mask)
    slow = generate(model, prompt, 16, greedy=True, prompt_padding_mask=mask, use_cache=False)
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_decoder_with_staggered_slots_matches_its_python_step(family):
    model = build(family, seed=2)
    native, python = BatchDecoder(model), BatchDecoder(model, native=False)
    assert native.native is not None and python.native is None
    prompts = [[5, 17, 3, 99, 42], [7, 8], [60, 61, 62, 63, 64, 65, 66]]
    slots: list[list] = [[], []]  # per decoder, the active slots
    fed: list[int] = []
    for step in range(14):
        if step in (0, 3, 7):  # a request joins between steps, at its own position
            ids = prompts[(0, 3, 7).index(step)]
            for decoder, active in zip((native, python), slots, strict=True):
                slot, logits = decoder.prefill(ids, max_new=16)
                active.append(slot)
            fed.append(int(logits.argmax()))
        a = native.step(slots[0], fed)
        b = python.step(slots[1], fed)
        assert relative(a, b) <= 1e-5
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        assert [s.length for s in slots[0]] == [s.length for s in slots[1]]
        fed = b.argmax(-1).tolist()


def test_a_batch_row_equals_the_row_alone_bit_for_bit():
    """Every output is computed by the same instructions whatever the batch, block and float products alike."""
    for model in (build("llama-style", seed=3), ob.quantize(build("llama-style", seed=3, sizes=WIDE), "q4_1")):
        decoder = BatchDecoder(model)
        together = [decoder.prefill([9, 8, 7], 5)[0], decoder.prefill([1, 2, 3, 4, 5, 6], 5)[0]]
        alone = [decoder.prefill([1, 2, 3, 4, 5, 6], 5)[0]]
        for token in (4, 40, 17):
            both = decoder.step(together, [token, token])
            one = decoder.step(alone, [token])
            assert torch.equal(both[1], one[0])


def test_threads_and_instruction_sets_agree():
    model = build("llama-style", seed=4)
    prompts = [[5, 17, 3], [7, 8, 9, 10]]
    scalar, python = decode_across_threads_and_isas(model, prompts)
    assert relative(scalar, python) <= 1e-5


@pytest.mark.parametrize(
    ("family", "fmt"),
    [
        *((family, "q4_1") for family in WIDE_FAMILIES),
        ("llama-style", "q4_0"),
        ("llama-style", "q5_0"),
        ("gpt2-style", "q5_1"),
    ],
)
def test_block_weights_native_step_is_as_faithful_as_the_python_step(family, fmt):
    exact = build(family, seed=5, sizes=WIDE)
    quantized = ob.quantize(copy.deepcopy(exact), fmt)
    text = torch.randint(0, 211, (3, 41), generator=torch.Generator().manual_seed(6))
    feed = text[:, 1:].T.tolist()  # teacher forcing: every step is fed the text's next token
    native, python = decode_both(quantized, text[:, :1], steps=40, feed=feed)
    with torch.no_grad():
        reference = exact(text[:, :40]).transpose(0, 1)  # (40, 3, V)
    kl_native, kl_python = (
        kl_to(reference.flatten(0, 1), native.flatten(0, 1)),
        kl_to(reference.flatten(0, 1), python.flatten(0, 1)),
    )
    assert kl_native <= 1.1 * kl_python + 1e-4, (kl_native, kl_python)
    assert (native.argmax(-1) == python.argmax(-1)).float().mean().item() >= 0.95


def test_the_python_step_runs_where_the_native_one_would_differ(monkeypatch):
    from oneblock.adapters.apply import apply_lora
    from oneblock.adapters.lora import LoraConfig

    model = build("llama-style", seed=7)
    run = prepare(model, [[1, 2, 3]], 4, False, None, None, None, None)
    assert LeanDecode(run, cache_dtype=torch.bfloat16).native is None  # a narrower cache
    assert LeanDecode(run, compile="aot_eager").native is None  # compiling asks for the Python step
    monkeypatch.setenv(ENV, "0")
    assert NativeStep.of(model) is None and LeanDecode(run).native is None
    monkeypatch.delenv(ENV)
    apply_lora(model, LoraConfig(rank=2, alpha=4.0, targets=("all-linear",)))
    assert NativeStep.of(model.eval()) is None  # one adapter's LoraLinear keeps the Python step


def test_fake_implementation_gives_the_logits_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = build("gpt2-style", seed=8)
    plan = NativeStep.of(model)
    assert plan is not None
    cache = model.new_cache(3, max_len=10, chunk=10)
    keys, values = [layer.k for layer in cache.layers], [layer.v for layer in cache.layers]
    rows = torch.tensor([4, 5, 6])

    def step(tokens: torch.Tensor) -> torch.Tensor:
        return plan(tokens, rows, rows, torch.zeros(3, dtype=torch.long), keys, values)

    with FakeTensorMode(allow_non_fake_inputs=True):
        out = step(torch.tensor([1, 2, 3]))
    assert tuple(out.shape) == (3, 101) and out.dtype == torch.float32
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch.inference_mode():
        assert torch.equal(compiled(torch.tensor([1, 2, 3])), step(torch.tensor([1, 2, 3])))


SMOLLM2_TEXT = (
    "The printing press was invented in the fifteenth century by Johannes Gutenberg, a goldsmith from Mainz. "
    "Before it, books were copied by hand, which made them rare and expensive. Movable metal type, oil-based ink "
    "and a wooden press adapted from those used to make wine allowed a workshop to print hundreds of pages a day. "
    "Within fifty years presses were running in more than two hundred cities across Europe, and the price of books "
    "fell sharply. Pamphlets carried arguments about religion and politics faster than any preacher could travel, "
    "and scholars in distant towns could at last read the same text, page for page, and correct each other's "
    "mistakes. Rivers were once the roads of trade: barges carried grain, salt and timber downstream, and towns "
    "grew where two rivers met or where a bridge could be built. The railway changed that within a single "
    "lifetime. A journey that had taken a week by coach took a day by train, fresh fish reached inland markets, "
    "and clocks across a whole country were set to one time so that timetables could be printed and trusted. "
    "Bees find flowers by colour and scent, and tell each other where they are with a dance: the angle of the "
    "dance to the vertical gives the direction of the food relative to the sun, and its length gives the distance."
)
WINDOW = 64


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    from oneblock.errors import CheckpointError
    from oneblock.inference.smollm2 import load_smollm2

    try:
        quantized, tokenizer = load_smollm2()
    except CheckpointError as err:
        pytest.skip(str(err))
    exact, _ = load_smollm2(dtype=torch.float32)
    ids = tokenizer.encode(SMOLLM2_TEXT)
    windows = torch.tensor(ids[: len(ids) // WINDOW * WINDOW]).view(-1, WINDOW)  # (W, 64): one row per window
    return quantized, exact, windows


def test_smollm2_native_step_in_float32_and_in_its_q4_1_file(smollm2):
    """SmolLM2-135M-Instruct: the file's 4-bit matrices and tied Q8_0 head, and the same model dequantized; the
    text's windows side by side as a batch, fed token by token."""
    quantized, exact, windows = smollm2
    assert windows.shape[0] >= 4
    feed = windows[:, 1:].T.tolist()
    native, python = decode_both(exact, windows[:, :1], steps=WINDOW - 1, feed=feed)  # (63, W, V)
    assert relative(native, python) <= 1e-5  # measured 1.1e-6
    assert torch.equal(native.argmax(-1), python.argmax(-1))
    native4, python4 = decode_both(quantized, windows[:, :1], steps=WINDOW - 1, feed=feed)
    reference = python.flatten(0, 1)
    kl_native, kl_python = kl_to(reference, native4.flatten(0, 1)), kl_to(reference, python4.flatten(0, 1))
    assert kl_native <= 1.1 * kl_python, (kl_native, kl_python)
    assert (native4.argmax(-1) == python4.argmax(-1)).float().mean().item() >= 0.9
