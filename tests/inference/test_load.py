"""``load_model``: every kind of source gives the model and tokenizer the specific loaders give."""

from __future__ import annotations

import pytest
import torch

import oneblock as ob
from oneblock.errors import CheckpointError, InputError
from oneblock.inference.load import load_model
from oneblock.text.tokenizer import ByteTokenizer, Tokenizer


def test_preset_is_seeded_and_bytes_are_its_tokens():
    name = next(n for n, c in ob.PRESETS.items() if c.arch == "decoder" and c.vocab_size >= 256)
    first, second = load_model(name, seed=3), load_model(name, seed=3)
    assert first.kind == "preset" and first.source == name and isinstance(first.tokenizer, ByteTokenizer)
    state = second.model.state_dict()
    assert all(torch.equal(t, state[k]) for k, t in first.model.state_dict().items())
    assert not first.model.training and first.seconds > 0


def test_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    model = ob.build_model(ob.ModelConfig(vocab_size=256, d_model=32, n_heads=4, n_layers=1, max_seq_len=16))
    path = ob.save(model, tmp_path / "m.safetensors")
    loaded = load_model(path, dtype=torch.bfloat16)
    assert loaded.kind == "checkpoint" and isinstance(loaded.tokenizer, ByteTokenizer)
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    expected = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    assert all(torch.equal(t, expected[k]) for k, t in loaded.model.state_dict().items())


def test_every_tokenizer_satisfies_the_protocol():
    tok: Tokenizer = ByteTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo" and tok.chat_template is None
    with pytest.raises(InputError, match="has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_unknown_source_names_the_choices(tmp_path):
    with pytest.raises(CheckpointError, match=r"'nope' is neither a file, a directory nor a preset name.*'gpt2'"):
        load_model("nope")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        bad = tmp_path / "x.gguf"
        bad.write_bytes(b"definitely not the gguf magic bytes")
        load_model(bad)


def test_peak_rss_is_the_programs_own_not_its_parents():
    """``ru_maxrss`` survives ``exec``: a small program started by a large parent must still report its own peak."""
    import subprocess
    import sys

    from oneblock.inference.process import peak_rss_bytes

    ballast = torch.ones(400 * 2**20 // 4)  # 400 MB held by this process, so its high-water mark is above that
    assert peak_rss_bytes() > 400 * 2**20
    code = "from oneblock.inference.process import peak_rss_bytes; print(peak_rss_bytes())"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    del ballast
    assert 1_000_000 < child < 200 * 2**20


def test_a_gguf_files_tokenizer_is_built_and_its_lists_dropped_before_the_weights_are_read(tmp_path, monkeypatch):
    """The vocabulary's Python strings and the model's pages are never resident together: the tokenizer comes first,
    the lists it was built from leave the parsed file, the freed heap goes back to the system, then the weights."""
    from family_testing import LLAMA3_VOCAB, write_family_gguf

    import oneblock.inference.load as front
    from oneblock.io.gguf import load as gguf_load
    from oneblock.io.gguf.tokenizer import VOCABULARY_ARRAYS, GGUFTokenizer

    path = write_family_gguf(tmp_path, LLAMA3_VOCAB)
    events: list[str] = []
    build_tokenizer, build_model = GGUFTokenizer.from_gguf.__func__, gguf_load.from_gguf

    def tokenizer(cls, layout):
        assert "tokenizer.ggml.tokens" in layout.metadata
        events.append("tokenizer")
        return build_tokenizer(cls, layout)

    def model(layout, **options):
        events.append("model without " + ", ".join(k for k in VOCABULARY_ARRAYS if k not in layout.metadata))
        return build_model(layout, **options)

    monkeypatch.setattr(GGUFTokenizer, "from_gguf", classmethod(tokenizer))
    monkeypatch.setattr(gguf_load, "from_gguf", model)
    monkeypatch.setattr(front, "return_free_memory", lambda: events.append("trim") or True)
    monkeypatch.setattr(front, "empty_free_lists", lambda: events.append("empty"))
    loaded = load_model(path)
    assert events == ["empty", "tokenizer", "trim", "model without " + ", ".join(VOCABULARY_ARRAYS)]
    reference = build_tokenizer(GGUFTokenizer, path)  # the tokenizer is the file's, as read on its own
    text = "Hello, world! <|eot_id|>"
    assert loaded.tokenizer.encode(text) == reference.encode(text)
    assert loaded.tokenizer.vocab_size == reference.vocab_size == loaded.model.config.vocab_size


def test_return_free_memory_hands_back_a_freed_heap():
    """glibc keeps freed memory for later; after a burst of allocations is freed, ``malloc_trim`` returns some
    (with another C library, nothing is done and it says so)."""
    from oneblock.inference import process

    burst = [bytes(1000) + bytes([i % 256]) for i in range(50_000)]  # 50 MB of C heap (objects over 512 bytes)
    del burst
    assert process.return_free_memory() is (process._malloc_trim() is not None)


def _free_tuples_of_length_3() -> int:
    """How many freed 3-tuples the interpreter keeps for reuse (``sys._debugmallocstats``, written to stderr)."""
    import os
    import re
    import sys

    read, write = os.pipe()
    saved = os.dup(2)
    sys.stderr.flush()
    os.dup2(write, 2)
    try:
        sys._debugmallocstats()
        sys.stderr.flush()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(write)
    with os.fdopen(read) as f:
        found = re.search(r"(\d+) free 3-sized PyTupleObject", f.read())
    assert found is not None, "the interpreter reports no tuple free list"
    return int(found.group(1))


def test_empty_free_lists_empties_them_without_walking_or_collecting_anything():
    """The freed tuples the interpreter keeps go; the collection it takes frees no cycle (every object frozen, none
    walked), and the objects frozen before are frozen after, in the same number."""
    import gc

    class Node:
        pass

    enabled = gc.isenabled()
    gc.disable()  # no automatic collection meanwhile
    try:
        _empty_free_lists_walks_nothing(Node)
    finally:
        if enabled:
            gc.enable()


def _empty_free_lists_walks_nothing(node: type) -> None:
    import gc
    import weakref

    from oneblock.inference import process

    cycle = node()
    cycle.self = cycle  # type: ignore[attr-defined]
    alive = weakref.ref(cycle)
    del cycle  # garbage only a collection that walks it would free
    burst = [tuple(range(i, i + 3)) for i in range(5_000)]
    del burst
    assert _free_tuples_of_length_3() > 1_000
    frozen = gc.get_freeze_count()
    process.empty_free_lists()
    assert gc.get_freeze_count() == frozen
    if frozen:  # a process past its start-up (objects frozen): left alone
        return
    assert _free_tuples_of_length_3() == 0
    assert alive() is not None  # not collected: the collection walked nothing
    gc.collect()
    assert alive() is None


def test_empty_free_lists_leaves_frozen_objects_frozen():
    import gc

    from oneblock.inference import process

    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        collections = gc.get_stats()[2]["collections"]
        process.empty_free_lists()
        assert gc.get_freeze_count() == frozen and gc.get_stats()[2]["collections"] == collections
    finally:
        gc.unfreeze()
