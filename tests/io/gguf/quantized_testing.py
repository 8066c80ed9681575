"""Wide models of each architecture, quantized by llama.cpp's own quantizer as a user's 4-bit files are made.

The small models of ``converter_testing`` (width 64) are too narrow for a K-quant, whose rows are 256-value
super-blocks. These are the same families at width 256 (feed-forward 512, heads of 16 values as before, Qwen3's
of 48): every q/k/v/gate/up/down matrix reads rows of whole super-blocks. Qwen3 and Gemma 3 keep 4 heads, so their
attention output reads rows of 192 and 64 values, which llama.cpp's Q4_K_M stores in the 32-value formats
(Q5_0 for Q4_K, Q8_0 for Q6_K). The F32 conversion goes through llama.cpp's
``llama_model_quantize`` (llama-cpp-python's binding, default parameters) to Q4_0, Q4_1, Q4_K_M (which mixes Q4_K
with Q6_K), Q5_K_M, Q6_K and IQ4_XS (whose narrow rows take IQ4_NL). The vocabularies are those of the small models.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from converter_testing import SHARED, convert, kept, make_hf
from llamacpp_testing import llama_cpp_module

WIDE = {**SHARED, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 16, "num_key_value_heads": 8}
HEADS = {"qwen3": {"num_attention_heads": 4, "num_key_value_heads": 2}, "gemma3": {"num_attention_heads": 4}}
STD = 0.1  # the weights' deviation: at four times the width, each matrix scales as the small models' do
FTYPES = {
    "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K", "iq4_xs": "LLAMA_FTYPE_MOSTLY_IQ4_XS",
}  # fmt: skip


def quantize(source: Path, out: Path, kind: str) -> Path:
    """``source`` (an F32 GGUF file) quantized to ``kind`` (a key of ``FTYPES``) by llama.cpp into ``out``."""
    llama_cpp = llama_cpp_module()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[kind])
    params.nthread = 2
    done = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if done != 0:
        raise AssertionError(f"llama_model_quantize({source.name}, {kind}) returned {done}")
    return out


def made_wide(family: str) -> Path:
    """The wide HF directory of ``family`` with its F32 conversion (``f32.gguf``) and llama.cpp's quantizations of
    it (``q4_0.gguf``, ``q4_1.gguf``, ``q4_k_m.gguf``), made once and kept for later runs."""
    llama_cpp_module()

    def make(work: Path) -> None:
        make_hf(work, family, shared={**WIDE, **HEADS.get(family, {})}, std=STD)
        convert(work, work / "f32.gguf", "f32")
        for kind in FTYPES:
            quantize(work / "f32.gguf", work / f"{kind}.gguf", kind)

    import converter_testing

    return kept(f"wide-{family}", make, Path(converter_testing.__file__), Path(__file__))
