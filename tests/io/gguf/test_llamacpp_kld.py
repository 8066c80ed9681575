"""oneblock's 4-bit decoding is as faithful as llama.cpp's on the same file, measured as llama.cpp measures it.

SmolLM2-135M-Instruct Q4_1. The reference is the exact float32 model (the file's weights dequantized once, every
product in float32). A held-out English text of this repository's own (data/heldout.txt, about 4,300 tokens; over
a fifth of it the top-1 agreement of two engines moved by a point from one passage to the next) is cut into
windows of 256 tokens, each fed one token at a time through the decoding step with the key/value cache, on
both sides: oneblock's default path (block kernels, activations rounded to 8 bits per product) and llama.cpp's
(llama-cpp-python, the same file, its key/value cache in float32); then both again with float16 caches
(llama.cpp's default, oneblock's ``--cache-dtype float16``). The figures are those of
``llama-perplexity --kl-divergence``: the mean KL divergence from the reference and the top-1 agreement.

Bounds (from the issue that set them): oneblock's KLD at most 1.1x llama.cpp's, its top-1 agreement no more than
one point below. Two correct orders of summation end about this far apart, so logits within 1% of the range or 90%
of greedy tokens agreeing are not what a 4-bit path can promise; these are. The F32 GGUF that
``oneblock convert --to gguf --type f32`` writes, read by llama.cpp, is the float32 model: its KLD to oneblock's is
near zero (over the first three windows, each read in one pass: float32 products have no rounding that the decode
path could change). The float32 decode step, over the first window, is the float32 forward.

Without llama-cpp-python the tests skip with a message; under ``CI=true`` they fail (CI builds it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from llamacpp_testing import F16, llama_cpp_module, llama_cpp_windows

from oneblock.inference.fidelity import fidelity, full_logits, stepwise_logits, windows

pytestmark = pytest.mark.usefixtures("one_thread")  # oneblock's side; llama.cpp keeps its 2 threads
TEXT = Path(__file__).parent / "data" / "heldout.txt"
WINDOW = 256


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    llama_cpp_module()
    from oneblock.cli.main import main
    from oneblock.inference.smollm2 import load_smollm2, smollm2_gguf_path

    path = smollm2_gguf_path()
    exact, tokenizer = load_smollm2(dtype=torch.float32)
    quantized, _ = load_smollm2()
    parts = windows(tokenizer.encode(TEXT.read_text()), WINDOW)
    reference = [full_logits(exact, w) for w in parts]

    f32 = tmp_path_factory.mktemp("f32") / "smollm2-f32.gguf"
    assert main(["convert", str(path), str(f32), "--to", "gguf", "--type", "f32"]) == 0
    figures = {
        "oneblock": fidelity(reference, [stepwise_logits(quantized, w) for w in parts]),
        "llama.cpp": fidelity(reference, llama_cpp_windows(path, parts, stepwise=True)),
        # float32 products have no rounding for the decode path to change: one pass per window
        "llama.cpp f32": fidelity(reference[:3], llama_cpp_windows(f32, parts[:3], stepwise=False)),
        "oneblock f32 stepwise": fidelity(reference[:1], [stepwise_logits(exact, parts[0])]),
        # both caches in float16, llama.cpp's default: keys and values rounded as stored
        "oneblock f16 cache": fidelity(
            reference, [stepwise_logits(quantized, w, cache_dtype=torch.float16) for w in parts]
        ),
        "llama.cpp f16 cache": fidelity(reference, llama_cpp_windows(path, parts, stepwise=True, cache=F16)),
    }
    for name, f in figures.items():
        print(f"{name}: KLD {f.kld:.5f}, top-1 {f.top1:.2%} over {f.tokens} tokens")
    return figures


def test_the_text_spans_several_windows(figures):
    assert figures["oneblock"].tokens == figures["llama.cpp"].tokens >= 3 * (WINDOW - 1)


def test_the_4_bit_decode_path_is_as_faithful_as_llama_cpp_by_kl_divergence(figures):
    ours, theirs = figures["oneblock"], figures["llama.cpp"]
    assert ours.kld <= 1.1 * theirs.kld, (ours, theirs)


def test_the_4_bit_decode_path_ranks_the_first_token_as_often_as_llama_cpp(figures):
    ours, theirs = figures["oneblock"], figures["llama.cpp"]
    assert ours.top1 >= theirs.top1 - 0.01, (ours, theirs)


def test_the_f32_file_oneblock_writes_is_the_float32_model_in_llama_cpp(figures):
    assert figures["llama.cpp f32"].kld < 1e-4, figures["llama.cpp f32"]
    assert figures["llama.cpp f32"].top1 >= 0.99


def test_the_float32_decode_step_is_the_float32_forward(figures):
    exact = figures["oneblock f32 stepwise"]
    assert exact.kld < 1e-8 and exact.top1 == 1.0, exact


def test_with_float16_caches_the_decode_path_is_as_faithful_as_llama_cpp(figures):
    ours, theirs = figures["oneblock f16 cache"], figures["llama.cpp f16 cache"]
    assert ours.kld <= 1.1 * theirs.kld, (ours, theirs)
    assert ours.top1 >= theirs.top1 - 0.01, (ours, theirs)
    assert ours.kld != figures["oneblock"].kld  # the cache was float16: rounding moved the logits
