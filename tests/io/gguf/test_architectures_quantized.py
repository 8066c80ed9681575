"""Every architecture's 4-bit files, as llama.cpp's own quantizer makes them, are as faithful in oneblock as in
llama.cpp.

Each family is made wide enough for K-quants (``quantized_testing``: width 256, feed-forward 512) and converted
to F32 by llama.cpp's converter, then quantized by ``llama_model_quantize`` to Q4_K_M (Q4_K with Q6_K, and
Q5_0 / Q8_0 for the rows that are not whole super-blocks), Q4_0, Q4_1, Q5_K_M, Q6_K and IQ4_XS (IQ4_NL for
narrow rows). Over windows of random tokens fed one
at a time, as ``llama-perplexity --kl-divergence`` measures, both engines are compared with the float32 model
(the F32 file, one forward): oneblock's mean KL divergence at most 1.1x llama.cpp's on the same file, its top-1
agreement no more than a point lower. Over more than 100 tokens (two windows of 61, Phi-3 five of 24), so one
token decided the other way by a near tie is within the point. Every family runs Q4_K_M; Q4_0 and Q4_1 each run on
three families, Q5_K_M, Q6_K and IQ4_XS on two.

Q4_K_M keeps some layers' value rows in Q6_K: Qwen2's q/k/v projections of such a layer are not stacked, and each
keeps its own bias.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from converter_testing import FAMILIES
from llamacpp_testing import llama_cpp_module, llama_cpp_windows
from quantized_testing import HEADS, made_wide

from oneblock.errors import ConversionError
from oneblock.inference.fidelity import fidelity, full_logits, stepwise_logits
from oneblock.io.gguf import load as gguf_load
from oneblock.io.gguf.layout import read_layout
from oneblock.io.gguf.load import from_gguf
from oneblock.io.gguf.types import type_name

pytestmark = pytest.mark.usefixtures("one_thread")
WINDOWS = {"phi3": (5, 24)}  # llama.cpp turns Phi-3's sliding window off: compare within one window
LEGACY = {
    "q4_0": ("gemma2", "llama3", "phi3"),
    "q4_1": ("gemma3", "qwen3", "smollm3"),
    "q5_k_m": ("gemma2", "phi3"),
    "q6_k": ("gemma3", "phi3"),
    "iq4_xs": ("gemma2", "gemma3"),
}  # the other types, each on a few families (the small vocabularies: the quick ones)
KINDS = {name: ["q4_k_m", *(kind for kind, names in LEGACY.items() if name in names)] for name in sorted(FAMILIES)}
CASES = [(name, kind) for name, kinds in KINDS.items() for kind in kinds]  # a family's cases together


@functools.lru_cache(maxsize=1)
def _reference(name: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Windows of random ids and the float32 model's logits over each (a family's cases run one after another)."""
    exact = from_gguf(made_wide(name) / "f32.gguf", dtype=torch.float32)
    count, length = WINDOWS.get(name, (2, 61))
    ids = torch.randint(0, exact.config.vocab_size, (count, length), generator=torch.Generator().manual_seed(1))
    parts = ids.tolist()
    return parts, [full_logits(exact, window) for window in parts]


@pytest.mark.parametrize(("name", "kind"), CASES)
def test_a_4_bit_file_is_as_faithful_as_in_llama_cpp(name, kind):
    llama_cpp_module()
    path = made_wide(name) / f"{kind}.gguf"
    parts, reference = _reference(name)
    model = from_gguf(path)
    ours = fidelity(reference, [stepwise_logits(model, window) for window in parts])
    theirs = fidelity(reference, llama_cpp_windows(path, parts, stepwise=True))
    print(f"{name} {kind}: oneblock KLD {ours.kld:.6f} top-1 {ours.top1:.2%}; llama.cpp KLD {theirs.kld:.6f} ", end="")
    print(f"top-1 {theirs.top1:.2%}")
    assert ours.tokens > 100
    assert ours.kld <= 1.1 * theirs.kld
    assert ours.top1 >= theirs.top1 - 0.01


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_llama_cpps_q4_k_m_file_holds_k_quants_and_its_fallbacks(name):
    """Q4_K and Q6_K on rows of whole super-blocks; the attention output of the families with narrow heads, whose
    rows are not, in a 32-value format."""
    tensors = read_layout(made_wide(name) / "q4_k_m.gguf").tensors
    types = {key: type_name(t.ggml_type) for key, t in tensors.items()}
    assert {"Q4_K", "Q6_K"} <= set(Counter(types.values()))
    for key, t in tensors.items():
        if types[key] in ("Q4_K", "Q6_K"):
            assert t.shape[-1] % 256 == 0, (key, t.shape)
    narrow = {types[key] for key in tensors if key.endswith("attn_output.weight")}
    assert narrow == ({"Q5_0"} if name in HEADS else {"Q4_K"})


def _biases(model: torch.nn.Module, i: int) -> torch.Tensor | None:
    """Block ``i``'s query, key and value biases, stacked (``None`` where a projection has none)."""
    attn = model.blocks[i].attn
    if getattr(attn, "qkv_proj", None) is not None:
        return attn.qkv_proj.bias
    parts = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
    return None if any(p is None for p in parts) else torch.cat(parts)


def test_qwen2_projections_that_are_not_stacked_keep_their_biases():
    directory = made_wide("qwen2")
    exact = from_gguf(directory / "f32.gguf", dtype=torch.float32)
    model = from_gguf(directory / "q4_k_m.gguf")
    apart = [i for i, block in enumerate(model.blocks) if getattr(block.attn, "qkv_proj", None) is None]
    assert apart and len(apart) < len(model.blocks)  # Q4_K_M's Q6_K value rows: some layers stacked, some not
    for i in range(len(model.blocks)):
        q, k, v = (getattr(exact.blocks[i].attn, f"{p}_proj").bias for p in "qkv")
        assert torch.equal(_biases(model, i), torch.cat([q, k, v]))


def test_a_tensor_of_the_file_that_no_module_takes_is_refused(monkeypatch):
    monkeypatch.setattr(gguf_load, "_place_biases", lambda model, decoded: None)
    with pytest.raises(ConversionError, match=r"tensors \['blocks.2.attn.q_proj.bias'.*have no place"):
        from_gguf(made_wide("qwen2") / "q4_k_m.gguf")
