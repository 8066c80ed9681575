"""The explorer's JSON API on every decoder family oneblock loads, from the Hugging Face directory and from
llama.cpp's F32 conversion of it (``converter_testing.made``), against transformers' model of the same directory:
the card's parameter counts are transformers' numel and its block differences are the family's own; the analysis
of a text holds transformers' attention weights and next-token logits, and the block drawn as the family runs it.
"""

from __future__ import annotations

import pytest
import torch
from converter_testing import FAMILIES, made

from oneblock.explore.analysis import unpack
from oneblock.explore.loading import load_explore_model
from oneblock.io.gguf.tokenizer import GGUFTokenizer

pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient

from oneblock.explore.server import create_app

pytestmark = pytest.mark.usefixtures("one_thread")
LLAMA = ["norm", "ffn", "position", "n_kv_heads", "bias"]  # RMSNorm, SwiGLU, RoPE, GQA, no biases
GEMMA = ["norm_position", "norm", "ffn", "activation", "position"]
DIFFERENCES = {  # the keys of the card's block differences, in its order, for each family's file
    "qwen2": LLAMA,  # q/k/v biases alone: the "bias" row
    "qwen3": [*LLAMA[:4], "d_head", "bias", "qk_norm", "tie_embeddings"],
    "llama3": [*LLAMA[:3], "rope_scaling", *LLAMA[3:]],
    "gemma2": [*GEMMA, "n_kv_heads", "bias", "sliding_window", "attn_scale", "attn_softcap", "logit_softcap",
               "scale_embeddings"],
    "gemma3": [*GEMMA, "rope_local_theta", "n_kv_heads", "bias", "qk_norm", "sliding_window", "attn_scale",
               "scale_embeddings"],
    "granite": [*LLAMA, "attn_scale", "embedding_multiplier", "residual_multiplier", "logits_scaling"],
    "smollm3": [*LLAMA[:3], "no_rope_every", *LLAMA[3:]],
    "olmo2": ["norm_position", *LLAMA, "qk_norm", "qk_norm_span", "tie_embeddings"],
    "phi3": [*LLAMA[:3], "rope_scaling", *LLAMA[3:], "sliding_window", "tie_embeddings"],
}  # fmt: skip
CAPTIONS = {  # where the norms sit, in words that match the steps drawn
    "gemma2": "norm before and after each sublayer (RMSNorm)",
    "gemma3": "norm before and after each sublayer (RMSNorm)",
    "olmo2": "norm after each sublayer, before its residual add (RMSNorm)",
}
STEPS = {  # the self-attention sublayer's steps, as each family's block runs them
    "gemma2": ["norm", "self_attention", "norm", "add"],
    "gemma3": ["norm", "self_attention", "norm", "add"],
    "olmo2": ["self_attention", "norm", "add"],
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, directory of the family's files, transformers' model of it with eager attention, a directory the
    explorer opens: the family's own, or for Gemma (whose test files hold only a SentencePiece model) the same
    weights with the vocabulary of the GGUF file as ``tokenizer.json``, as a published Gemma directory has one)."""
    import transformers

    directory = made(request.param)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    opened = directory
    if not (directory / "tokenizer.json").is_file():
        opened = tmp_path_factory.mktemp(request.param)
        for name in ("config.json", "model.safetensors"):
            (opened / name).symlink_to(directory / name)
        GGUFTokenizer.from_gguf(directory / "f32.gguf").tokenizer.save(str(opened / "tokenizer.json"))
    return request.param, directory, reference, opened


def numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_card_and_analysis_are_transformers_model(family, source):
    name, directory, reference, opened = family
    explorable = (
        load_explore_model(hf=str(opened)) if source == "hf" else load_explore_model(model=str(directory / "f32.gguf"))
    )
    client = TestClient(create_app(explorable), base_url="http://127.0.0.1:8000")
    card = client.get("/api/card").json()
    parameters = card["parameters"]
    assert parameters["total"] == parameters["actual"] == numel(reference)
    assert [row["key"] for row in parameters["differences"]] == DIFFERENCES[name]
    assert all(check["passed"] for check in card["checks"])

    ids = torch.randint(0, reference.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(2))
    response = client.post("/api/analyze", json={"ids": ids[0].tolist(), "top_k": 3})
    assert response.status_code == 200, response.text
    result = response.json()
    with torch.no_grad():  # 30 tokens: past Gemma's and Phi-3's window of 24
        want = reference(ids, output_attentions=True)
    (attention,) = result["attention"]
    torch.testing.assert_close(unpack(attention["weights"]), torch.cat(want.attentions), rtol=0, atol=2e-5)
    logits = want.logits[0, -1]
    torch.testing.assert_close(
        unpack(result["next_token"]["logits"]), logits, rtol=0, atol=1e-4 * float(logits.abs().max())
    )
    assert [t["id"] for t in result["next_token"]["top"]] == logits.topk(3).indices.tolist()
    (stack,) = result["block"]["stacks"]
    assert stack["layers"] == reference.config.num_hidden_layers
    attention_steps = [step["op"] for step in stack["sublayers"][0]["steps"]]
    assert attention_steps == STEPS.get(name, ["norm", "self_attention", "add"])
    assert result["block"]["norm_caption"] == CAPTIONS.get(name, "norm before each sublayer (RMSNorm)")
