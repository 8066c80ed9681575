"""F16 and BF16 GGUF files, as llama.cpp's converter writes them (``--outtype f16`` / ``bf16``), kept as stored.

Every matrix loads as a two-byte ``BlockLinear`` (the file's bytes: no float32 copy, the model's memory the file's
size), multiplied in float32 with each value widened exactly. So the logits are the float32 model's of the same
file (``dtype=torch.float32``) within float32's summation order, on the prompt pass (4 x 4 blocks) and on the
decoding step (the native step, which equals the Python step); against llama.cpp on the same file, as faithful to
the F32 conversion (mean KL divergence, top-1 agreement).
"""

from __future__ import annotations

import pytest
import torch
from converter_testing import convert, made
from llamacpp_testing import llama_cpp_module, llama_cpp_windows

from oneblock.inference.fidelity import fidelity, full_logits, stepwise_logits
from oneblock.inference.generation import generate
from oneblock.io.gguf.layout import read_layout
from oneblock.io.gguf.load import from_gguf
from oneblock.layers.quantized import BlockEmbedding, BlockLinear

pytestmark = pytest.mark.usefixtures("one_thread")
FAMILIES = ["llama3", "qwen2", "phi3"]  # permuted q/k rows and a tied head; q/k/v biases; stacked matrices in the file
TYPES = {"f16": 1, "bf16": 30}  # GGUF type ids


@pytest.fixture(scope="module", params=[(f, t) for f in FAMILIES for t in TYPES], ids=lambda p: f"{p[0]}-{p[1]}")
def converted(request, tmp_path_factory):
    """(family, type, the HF directory, the file llama.cpp's converter wrote in that type)."""
    family, kind = request.param
    directory = made(family)
    return family, kind, directory, convert(directory, tmp_path_factory.mktemp(family) / f"{kind}.gguf", kind)


def _ids(n: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(2))


def _spread(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / (b.max() - b.min())).item()


def test_every_matrix_stays_as_the_file_stores_it(converted):
    _, kind, _, path = converted
    model = from_gguf(path)
    matrices = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert matrices == [], "a matrix was widened to float32"
    layers = {id(m): m for m in model.modules() if isinstance(m, BlockLinear)}
    assert {m.fmt for m in layers.values()} == {kind}
    assert isinstance(model.embed.tok, BlockEmbedding) and model.embed.tok.fmt == kind
    held = {m.blocks.data_ptr(): m.blocks.numel() for m in [*layers.values(), model.embed.tok]}
    stored = sum(t.data.numel() for t in read_layout(path).tensors.values() if t.ggml_type == TYPES[kind])
    assert sum(held.values()) == stored  # two bytes a weight, each byte once (a tied head shares the table)


def test_the_logits_are_the_float32_models_of_the_same_file(converted):
    _, _, _, path = converted
    exact = from_gguf(path, dtype=torch.float32)
    kept = from_gguf(path)
    ids = _ids(80, exact.config.vocab_size)
    # Float32 sums in another order than the float32 model's GEMM: 1e-4 of the range, as for the F32 file.
    with torch.no_grad():
        assert _spread(kept(ids)[0], exact(ids)[0]) < 1e-4  # the prompt pass: 4 x 4 blocks
        assert _spread(kept(ids[:, :3])[0], exact(ids[:, :3])[0]) < 1e-4  # fewer than 4 rows: row by row
    stats: dict = {}
    _, logits = generate(kept, ids[:, :20], 12, greedy=True, return_logits=True, stats=stats)
    _, reference = generate(exact, ids[:, :20], 12, greedy=True, return_logits=True)
    assert stats["decode_step"] == "native"
    assert _spread(logits, reference) < 1e-4


def test_the_native_step_equals_the_python_step(converted, monkeypatch):
    _, _, _, path = converted
    model = from_gguf(path)
    ids = _ids(30, model.config.vocab_size)
    native: dict = {}
    _, fast = generate(model, ids, 10, greedy=True, return_logits=True, stats=native)
    monkeypatch.setenv("ONEBLOCK_NATIVE_STEP", "0")
    python: dict = {}
    _, slow = generate(model, ids, 10, greedy=True, return_logits=True, stats=python)
    assert (native["decode_step"], python["decode_step"]) == ("native", "python")
    assert _spread(fast, slow) < 1e-5


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_as_faithful_to_the_f32_file_as_llama_cpp(kind, tmp_path):
    llama_cpp_module()
    directory = made("llama3")
    path = convert(directory, tmp_path / f"{kind}.gguf", kind)
    exact = from_gguf(directory / "f32.gguf", dtype=torch.float32)
    window = _ids(129, exact.config.vocab_size)[0].tolist()
    reference = [full_logits(exact, window)]
    ours = fidelity(reference, [stepwise_logits(from_gguf(path), window)])
    theirs = fidelity(reference, llama_cpp_windows(path, [window], stepwise=True))
    print(f"{kind}: oneblock KLD {ours.kld:.3g} top-1 {ours.top1:.2%}; llama.cpp {theirs.kld:.3g} {theirs.top1:.2%}")
    assert ours.kld <= 1.1 * theirs.kld
    assert ours.top1 >= theirs.top1 - 0.01
