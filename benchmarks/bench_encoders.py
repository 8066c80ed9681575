"""``bench.py``'s encoder sections: BERT-base against transformers' ``BertModel``, and all-MiniLM-L6-v2's sentence
embeddings against sentence-transformers, on the same weights and inputs."""

from __future__ import annotations

from typing import Any

import torch
from bench_report import heading
from timing import interleaved, speedup

import oneblock as ob


def bench_bert(rounds: int, budget: float) -> dict[str, Any]:
    import transformers

    torch.manual_seed(0)
    hf = transformers.BertModel(transformers.BertConfig(attn_implementation="sdpa"), add_pooling_layer=False).eval()
    ours = ob.from_hf(hf)
    b, t = 8, 128
    x = torch.randint(0, hf.config.vocab_size, (b, t), generator=torch.Generator().manual_seed(2))
    lengths = torch.tensor([128, 120, 110, 100, 96, 80, 64, 128])
    mask = torch.arange(t)[None] < lengths[:, None]  # (B, T) right padding
    calls = {
        "oneblock": lambda: ours(x, padding_mask=mask),
        "transformers": lambda: hf(input_ids=x, attention_mask=mask.long()).last_hidden_state,
    }
    with torch.inference_mode():
        diff = (calls["oneblock"]() - calls["transformers"]())[mask].abs().max().item()
    times = interleaved(calls, rounds=rounds, budget=budget * 30)
    rate = {name: b * t / s["median"] for name, s in times.items()}
    heading("BERT-base encoder, B=8, T=128 padded batch (tokens/s)")
    print(
        f"  oneblock {rate['oneblock']:.0f}  transformers {rate['transformers']:.0f}   "
        f"x{speedup(times, 'oneblock', 'transformers'):.2f}; max |diff| {diff:.1e}"
    )
    return {"tokens_per_s": rate, "speedup": speedup(times, "oneblock", "transformers"), "max_abs_diff": diff}


def bench_minilm(rounds: int, budget: float) -> dict[str, Any]:
    from sentence_transformers import SentenceTransformer

    from oneblock.inference.embedding import default_model_dir, load_sentence_model

    directory = default_model_dir()
    ours = load_sentence_model(directory)
    st = SentenceTransformer(str(directory), device="cpu")
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards"]
    words += ["quietly", "judge", "boxing", "matches"]
    texts = [" ".join(words[(i * 7) % len(words) :] + words[: (i * 3) % 11]) for i in range(128)]
    calls = {
        "oneblock": lambda: ours.encode(texts, batch_size=32),
        "sentence-transformers": lambda: st.encode(texts, batch_size=32, convert_to_tensor=True),
    }
    with torch.inference_mode():
        diff = (calls["oneblock"]() - calls["sentence-transformers"]().cpu()).abs().max().item()
    times = interleaved(calls, rounds=rounds, budget=budget * 30)
    rate = {name: len(texts) / s["median"] for name, s in times.items()}
    heading("all-MiniLM-L6-v2 sentence embeddings, 128 texts, batch 32 (texts/s)")
    print(
        f"  oneblock {rate['oneblock']:.0f}  sentence-transformers {rate['sentence-transformers']:.0f}   "
        f"x{speedup(times, 'oneblock', 'sentence-transformers'):.2f}; max |diff| {diff:.1e}"
    )
    return {"texts_per_s": rate, "speedup": speedup(times, "oneblock", "sentence-transformers"), "max_abs_diff": diff}
