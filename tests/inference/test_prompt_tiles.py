"""A prompt's pass with bfloat16 tiles (oneblock.kernels.tiles), on SmolLM2-135M-Instruct Q4_1.

Faithfulness is measured as for the 4-bit decode path (tests/io/gguf/test_llamacpp_kld.py): over the held-out
text's first four windows of 256, the mean KL divergence from the exact float32 model and the top-1 agreement.
Measured on an Intel Xeon with AMX: KLD 0.00052, top-1 97.4% (the 4-bit decode path: about 0.0028 and 95.8%);
on an AMD EPYC (Zen 4): 0.00053 and 97.25%. The bounds leave twice that KLD. The integer products (int8: activations
quantized to 8 bits as in decoding) measured 0.00302 and 96.4% on Zen 4, and on the first window 0.00286 against the
decode path's 0.00273 over the same tokens. Generation's prompt pass and the server's chunked read both take the
tiles ``ONEBLOCK_TILES`` names, up to the last block's output projection and feed-forward, which run on the last
row alone (the one-row kernels decoding runs). Under int8, a model whose matrices are all interleaved (this one) is
read by the native step instead, in both: the same integer products, rows that compute what decoding them one at a
time computes, bit for bit (tests/inference/test_native_long_prompt.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from oneblock.inference.fidelity import fidelity, full_logits, stepwise_logits, windows
from oneblock.inference.native_step import NativeStep
from oneblock.kernels.tiles import ENV, prompt_tiles

pytestmark = pytest.mark.usefixtures("one_thread")
TEXT = Path(__file__).parents[1] / "io" / "gguf" / "data" / "heldout.txt"


@pytest.fixture(scope="module")
def models():
    from oneblock.inference.smollm2 import load_smollm2

    exact, tokenizer = load_smollm2(dtype=torch.float32)
    fast, _ = load_smollm2()
    return exact, fast, tokenizer


def test_bfloat16_tiles_stay_closer_to_float32_than_the_4bit_decode_path_and_int8_as_close(models):
    exact, fast, tokenizer = models
    parts = windows(tokenizer.encode(TEXT.read_text()), 256)[:4]  # the text's first 1,024 tokens
    reference = [full_logits(exact, w) for w in parts]
    with torch.inference_mode():
        with prompt_tiles(torch.float32):
            float_tiles = fidelity(reference, [full_logits(fast, w) for w in parts])
        with prompt_tiles(torch.bfloat16):
            bf16_tiles = fidelity(reference, [full_logits(fast, w) for w in parts])
        with prompt_tiles(torch.int8):
            int8 = [full_logits(fast, w) for w in parts]
    stepwise = [stepwise_logits(fast, w) for w in parts[:1]]
    int8_fidelity, decoded = fidelity(reference, int8), fidelity(reference[:1], stepwise)
    first = fidelity(reference[:1], int8[:1])
    print(f"int8: KLD {int8_fidelity.kld:.5f}, top-1 {int8_fidelity.top1:.2%}; first window {first.kld:.5f}, decoded")
    print(f" one token at a time {decoded.kld:.5f}")
    print(
        f"float32 tiles: KLD {float_tiles.kld:.6f}; "
        f"bfloat16 tiles: KLD {bf16_tiles.kld:.5f}, top-1 {bf16_tiles.top1:.2%}"
    )
    assert float_tiles.kld < 1e-6 and float_tiles.top1 == 1.0  # the file's exact weights, float32 products
    assert 0 < bf16_tiles.kld <= 0.001 and bf16_tiles.top1 >= 0.96
    # int8: 8-bit activations, as the decode path and llama.cpp's prompt: its faithfulness, not bfloat16's
    assert int8_fidelity.kld <= 0.006 and int8_fidelity.top1 >= 0.95
    assert first.kld <= 1.2 * decoded.kld


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_generation_and_the_chunked_read_take_the_tiles_the_setting_names(dtype, models, monkeypatch):
    from oneblock.inference.generation import generate
    from oneblock.inference.prefill import Prefill

    _, fast, tokenizer = models
    ids = tokenizer.encode(TEXT.read_text())[:40]  # one chunk of the server's read, 40 rows: the float tiles
    with torch.inference_mode(), prompt_tiles(getattr(torch, dtype)):
        last = fast.run(torch.tensor([ids]), last_only=True)  # (1, 1, C): the rows in one pass, the last one's out
        expected = fast.logits(last[:, -1])[0]  # (V,)
    monkeypatch.setenv(ENV, dtype)
    native = NativeStep.of(fast)
    if dtype == "int8" and native is not None and native.reads(len(ids)):  # every matrix interleaved: native reads
        with torch.inference_mode():
            expected = native.prompt(torch.tensor(ids), 0, fast.new_cache(1, max_len=len(ids)))
    _, logits = generate(fast, torch.tensor(ids), max_new_tokens=1, greedy=True, return_logits=True)
    torch.testing.assert_close(logits[0], expected, rtol=0, atol=1e-4 * float(expected.abs().max()))
    read = Prefill(fast, ids, fast.new_cache(1, max_len=len(ids)), native=native)  # as the server makes it
    got = read.advance()
    assert got is not None
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 * float(expected.abs().max()))
    other = "bfloat16" if dtype == "float32" else "float32"
    with torch.inference_mode(), prompt_tiles(getattr(torch, other)):
        other_logits = fast.logits(fast.run(torch.tensor([ids]), last_only=True)[:, -1])[0]
    assert (other_logits - expected).abs().max() > 1e-3 * expected.abs().max()
