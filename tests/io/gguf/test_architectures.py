"""Every architecture of :mod:`oneblock.io.gguf.archs` against references nobody here wrote.

Each family (Qwen2 with its q/k/v biases, Qwen3 with its per-head q/k norms and a head width of its own, Llama 3
with its rescaled rotary frequencies, Gemma 2 with sandwich norms, GeGLU, soft-caps and a sliding window on every
other layer, Gemma 3 with q/k norms, five local layers to one global and two rotary bases, Granite with its four
scalars, SmolLM3 without rotary in every fourth layer, OLMo 2 with norms after the sublayers, Phi-3 with stacked
matrices, partial rotary, LongRoPE and a window on every layer) is made as a user's
files are (``converter_testing``): transformers from a config with every parameter randomised, then llama.cpp's own
converter, to F32 and to Q8_0. Sequences run to 300 positions, past Llama 3's ``original_max_position_embeddings``
of 64 and Gemma's window of 24, so the scaled frequencies and the window matter.

* the Hugging Face directory: oneblock's logits equal transformers' within 1e-5 of the logits' range;
* the F32 GGUF file: within 1e-4 of the range (llama.cpp's converter wrote it: names, row order, rope_freqs);
* the Q8_0 file in llama.cpp (llama-cpp-python) and in oneblock, each against the float32 model: oneblock's mean
  KL divergence at most 1.1x llama.cpp's, top-1 agreement no more than a point lower;
* cached decoding (the native step, which computes every family's options) equals the full forward, and the
  native step equals the Python step;
* the file's tokenizer, rebuilt by oneblock, equals transformers' on the directory;
* the directory loaded into oneblock and written by ``save_gguf`` is llama.cpp's own F32 conversion again: the
  same keys and tensors, the model's logits when oneblock reads it back, llama.cpp's logits on its own file.
"""

from __future__ import annotations

import pytest
import torch
from converter_testing import FAMILIES, made
from llamacpp_testing import llama_cpp_module, llama_cpp_windows

from oneblock.adapters.apply import apply_lora, lora_modules
from oneblock.adapters.gguf import save_gguf_adapter
from oneblock.adapters.lora import LoraConfig
from oneblock.errors import ConversionError
from oneblock.inference.fidelity import fidelity, full_logits, stepwise_logits
from oneblock.inference.generation import generate
from oneblock.inference.load import load_model
from oneblock.io.gguf.archs import ARCHITECTURES, architecture_of
from oneblock.io.gguf.layout import read_layout
from oneblock.io.gguf.load import from_gguf
from oneblock.io.gguf.tokenizer import GGUFTokenizer
from oneblock.io.gguf.write import save_gguf
from oneblock.io.gguf.writer import typed_metadata
from oneblock.io.hf.convert import from_hf

pytestmark = pytest.mark.usefixtures("one_thread")
LENGTH = 300
LLAMA_CPP_SPAN = {"phi3": 24}  # llama.cpp turns Phi-3's sliding window off: compare within one window


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    """(name, directory holding the HF model, f32.gguf and q8_0.gguf, transformers' model, ids, its logits)."""
    import transformers

    directory = made(request.param)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = torch.randint(0, reference.config.vocab_size, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = reference(ids).logits[0]  # (T, V)
    return request.param, directory, ids, logits


def _spread(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference as a fraction of the reference logits' range."""
    return float((got - want).abs().max() / (want.max() - want.min()))


def _same_top1_where_decided(reference: list[torch.Tensor], candidate: list[torch.Tensor]) -> bool:
    """Whether the top-1 tokens agree wherever the reference's best two logits are more than 1e-4 of its range
    apart: two float32 engines (and llama.cpp's threads, whose split follows the machine's load) may order a tie
    either way."""
    for ref, cand in zip(reference, candidate, strict=True):
        top2 = ref.double().topk(2, dim=-1).values  # (W - 1, 2)
        decided = top2[:, 0] - top2[:, 1] > 1e-4 * float(ref.max() - ref.min())
        if not torch.equal(ref.argmax(-1)[decided], cand.argmax(-1)[decided]):
            return False
    return True


def test_the_hugging_face_directory_computes_transformers_logits(family):
    _, directory, ids, want = family
    with torch.no_grad():
        got = from_hf(directory)(ids)[0]
    assert _spread(got, want) < 1e-5


def test_the_converted_f32_file_computes_transformers_logits(family):
    name, directory, ids, want = family
    model = from_gguf(directory / "f32.gguf", dtype=torch.float32)
    assert model.config.extra["gguf_architecture"] == {"llama3": "llama"}.get(name, name)
    with torch.no_grad():
        got = model(ids)[0]
    assert _spread(got, want) < 1e-4


BLOCK = {
    "qkv_bias": False, "qk_norm": False, "qk_norm_span": "head", "rope": None, "d_head": 16, "norm_position": "pre",
    "ffn": "swiglu", "scale_embeddings": False, "attn_softcap": None, "logit_softcap": None, "sliding_window": None,
    "global_every": 1, "rope_local_theta": None, "embedding_multiplier": 1.0, "residual_multiplier": 1.0,
    "logits_scaling": 1.0, "no_rope_every": 0, "rope_dims": 16,
}  # fmt: skip
GEMMA = {"norm_position": "sandwich", "ffn": "gated", "scale_embeddings": True, "sliding_window": 24}
OPTIONS = {  # what each family's file sets beyond the Llama block
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True, "d_head": 48, "rope_dims": 48},
    "llama3": {"rope": "factors"},
    "gemma2": {**GEMMA, "attn_softcap": 5.0, "logit_softcap": 3.0, "global_every": 2},
    "gemma3": {**GEMMA, "qk_norm": True, "global_every": 6, "rope_local_theta": 10000.0},
    "granite": {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 8.0},
    "smollm3": {"no_rope_every": 4},
    "olmo2": {"norm_position": "output", "qk_norm": True, "qk_norm_span": "width"},
    "phi3": {"rope_dims": 12, "rope": "longrope", "sliding_window": 24, "global_every": 4},
}


def test_each_family_sets_its_options_of_the_block(family):
    name, directory, _, _ = family
    cfg = from_gguf(directory / "f32.gguf", dtype=torch.float32).config
    found = {key: getattr(cfg, key) for key in BLOCK if key != "rope"}
    found = {key: round(v, 6) if isinstance(v, float) else v for key, v in found.items()}  # GGUF stores float32
    found["rope"] = cfg.rope_scaling.get("type")
    assert found == {**BLOCK, **OPTIONS[name]}


def test_cached_decoding_equals_the_full_forward(family):
    _, directory, ids, _ = family
    model = from_gguf(directory / "f32.gguf", dtype=torch.float32)
    stats: dict = {}
    out, logits = generate(model, ids[:, :40], 24, greedy=True, return_logits=True, stats=stats)
    with torch.no_grad():
        full = model(out[:, :-1])[0, 39:]  # (24, V): the same positions in one forward
    assert _spread(logits[0], full) < 1e-5
    assert stats["decode_step"] == "native"


def test_the_native_step_equals_the_python_step(family, monkeypatch):
    _, directory, ids, _ = family
    model = from_gguf(directory / "f32.gguf", dtype=torch.float32)
    native: dict = {}
    _, fast = generate(model, ids[:, :40], 16, greedy=True, return_logits=True, stats=native)
    monkeypatch.setenv("ONEBLOCK_NATIVE_STEP", "0")
    python: dict = {}
    _, slow = generate(model, ids[:, :40], 16, greedy=True, return_logits=True, stats=python)
    assert (native["decode_step"], python["decode_step"]) == ("native", "python")
    assert native["decode_step_reason"] is None
    assert "ONEBLOCK_NATIVE_STEP" in python["decode_step_reason"]
    assert _spread(fast, slow) < 1e-5


def test_the_q8_0_file_is_as_faithful_as_in_llama_cpp(family):
    llama_cpp_module()
    _, directory, ids, _ = family
    exact = from_gguf(directory / "f32.gguf", dtype=torch.float32)
    window = ids[0, : LLAMA_CPP_SPAN.get(family[0], 129)].tolist()
    reference = [full_logits(exact, window)]
    ours = fidelity(reference, [stepwise_logits(from_gguf(directory / "q8_0.gguf"), window)])
    theirs = fidelity(reference, llama_cpp_windows(directory / "q8_0.gguf", [window], stepwise=True))
    print(f"oneblock KLD {ours.kld:.6f} top-1 {ours.top1:.2%}; llama.cpp KLD {theirs.kld:.6f} top-1 {theirs.top1:.2%}")
    assert ours.kld <= 1.1 * theirs.kld
    assert ours.top1 >= theirs.top1 - 0.01


def test_the_f32_file_is_the_float32_model_in_llama_cpp(family):
    llama_cpp_module()
    _, directory, ids, _ = family
    window = ids[0, : LLAMA_CPP_SPAN.get(family[0], 65)].tolist()
    exact = from_gguf(directory / "f32.gguf", dtype=torch.float32)
    ours, theirs = [full_logits(exact, window)], llama_cpp_windows(directory / "f32.gguf", [window], stepwise=False)
    assert fidelity(ours, theirs).kld < 1e-6
    assert _same_top1_where_decided(ours, theirs)


@pytest.mark.parametrize("name", sorted(n for n, (_, _, vocab) in FAMILIES.items() if vocab != "spm"))
def test_the_files_byte_level_tokenizer_is_transformers(name):
    from transformers import AutoTokenizer

    directory = made(name)
    ours = GGUFTokenizer.from_gguf(directory / "f32.gguf")
    theirs = AutoTokenizer.from_pretrained(directory)
    text = "Hello world 12345, it's  a\n\n test of 3.14159 \u00e9t\u00e9 \U0001f680!"
    assert ours.encode(text, add_bos=False) == theirs.encode(text, add_special_tokens=False)


def test_an_architecture_oneblock_does_not_run_is_refused_naming_those_it_does():
    with pytest.raises(ConversionError, match=r"'mistral3' is not supported; oneblock runs llama .*qwen2 .*phi3"):
        architecture_of({"general.architecture": "mistral3"})
    assert set(ARCHITECTURES) >= {"llama", "qwen2", "qwen3", "gemma2", "gemma3", "granite", "olmo2", "smollm3", "phi3"}


@pytest.fixture(scope="module")
def written(family, tmp_path_factory):
    """The family's directory loaded into oneblock (float32), written by ``save_gguf`` as F32 with the tokenizer of
    llama.cpp's conversion, and the loaded model's logits."""
    name, directory, ids, _ = family
    model = from_hf(directory)
    assert next(model.parameters()).dtype == torch.float32
    path = tmp_path_factory.mktemp("written") / f"{name}.gguf"
    save_gguf(model, path, vocabulary=typed_metadata(directory / "f32.gguf", ("tokenizer.",)))
    with torch.no_grad():
        logits = model(ids)[0]
    return path, logits


def test_a_written_file_reads_back_as_the_model(family, written):
    path, want = written
    with torch.no_grad():
        got = from_gguf(path, dtype=torch.float32)(family[2])[0]
    assert _spread(got, want) < 1e-5


SAME_EXCEPT = {  # keys that legitimately differ from llama.cpp's conversion of the same directory
    "general.name", "general.finetune", "general.size_label",  # the converter names a file from its directory
    "oneblock.sha256",  # the digest of its bytes that oneblock writes into every file
}  # fmt: skip
FAMILY_EXCEPT = {
    # Llama files as oneblock wrote them before the other architectures: no quantization version in an F32 file,
    # and the head width only where it is not C / H (the converter copies transformers' head_dim)
    "llama3": {"general.quantization_version", "llama.attention.key_length", "llama.attention.value_length"},
}


def _values(path) -> tuple[dict, dict]:
    layout = read_layout(path)
    plain = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in layout.metadata.items()}
    return plain, {name: (t.shape, t.ggml_type) for name, t in layout.tensors.items()}


def test_a_written_file_has_the_keys_and_tensors_of_llama_cpps_conversion(family, written):
    name, directory, _, _ = family
    (ours, our_tensors), (theirs, their_tensors) = _values(written[0]), _values(directory / "f32.gguf")
    skip = SAME_EXCEPT | FAMILY_EXCEPT.get(name, set())
    assert {k: v for k, v in ours.items() if k not in skip} == {k: v for k, v in theirs.items() if k not in skip}
    assert our_tensors == their_tensors


def test_llama_cpp_runs_a_written_file_as_its_own_conversion(family, written):
    llama_cpp_module()
    name, directory, ids, _ = family
    window = ids[0, : LLAMA_CPP_SPAN.get(name, 65)].tolist()
    theirs = llama_cpp_windows(directory / "f32.gguf", [window], stepwise=False)
    written_logits = llama_cpp_windows(written[0], [window], stepwise=False)
    assert fidelity(theirs, written_logits).kld < 1e-6
    assert _same_top1_where_decided(theirs, written_logits)


def _adapted(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``model`` with an all-linear LoRA adapter whose B is random (an initial adapter changes nothing)."""
    apply_lora(model, LoraConfig(rank=3, alpha=6.0, targets=("all-linear",)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in lora_modules(model).values():
            module.lora_B.weight.copy_(0.2 * torch.randn(module.lora_B.weight.shape, generator=gen))
    return model.eval()


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_llama_cpp_applies_a_written_adapter_as_oneblock_does(family, written, source, tmp_path):
    """An adapter on the directory's model (Phi-3: peft's on the stacked matrices) or on the file's (Phi-3: one per
    part), written by ``save_gguf_adapter`` for the architecture the base is written as, over the written base in
    llama.cpp: oneblock's logits with the adapter."""
    llama_cpp_module()
    name, directory, ids, _ = family
    base = from_hf(directory) if source == "hf" else from_gguf(directory / "f32.gguf", dtype=torch.float32)
    model = _adapted(base, seed=3)
    adapter = save_gguf_adapter(model, tmp_path / "adapter.gguf")
    assert (
        read_layout(adapter).metadata["general.architecture"]
        == read_layout(written[0]).metadata["general.architecture"]
    )
    window = ids[0, : LLAMA_CPP_SPAN.get(name, 65)].tolist()
    with torch.no_grad():
        ours = full_logits(model, window)
        plain = full_logits(from_hf(directory), window)
    assert _spread(ours, plain) > 1e-3  # the adapter changes the logits
    theirs = llama_cpp_windows(written[0], [window], stepwise=False, lora_path=adapter)
    assert fidelity([ours], theirs).kld < 1e-6
    assert _same_top1_where_decided([ours], theirs)


def test_a_longrope_file_beyond_its_original_context_computes_llama_cpps_logits(tmp_path):
    """Phi-3's file keeps LongRoPE's two tables (and so does the file oneblock writes); at a context beyond the
    original (4), oneblock runs the long ones, as llama.cpp does for an ``n_ctx`` beyond it."""
    llama_cpp_module()
    directory = made("phi3")
    model = load_model(directory / "f32.gguf", dtype=torch.float32, context=24).model
    scaling = model.config.rope_scaling
    assert (model.config.max_seq_len, scaling["original_max_position_embeddings"]) == (24, 4)
    for path in (directory / "f32.gguf", save_gguf(model, tmp_path / "written.gguf")):
        tables = read_layout(path).tensors
        for key, name in (("short_factors", "rope_factors_short.weight"), ("long_factors", "rope_factors_long.weight")):
            assert tables[name].checked_data().view(torch.float32).tolist() == pytest.approx(scaling[key])
    assert scaling["short_factors"] != pytest.approx(scaling["long_factors"])
    window = torch.randint(0, model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    (theirs,) = llama_cpp_windows(directory / "f32.gguf", [window], stepwise=False)
    assert _spread(full_logits(model, window), theirs) < 1e-4
    short = from_gguf(directory / "f32.gguf", dtype=torch.float32, context=4)  # the short factors
    assert _spread(full_logits(short, window[:4]), theirs[:3]) > 1e-3
