"""Reading, rendering and masking fine-tuning data: what is trained is exactly the assistant's answers and their
end-of-turn token, in the ids the chat template gives; every kind of bad data is refused by name."""

from __future__ import annotations

import json

import pytest
from finetune_testing import chat, write_jsonl

from oneblock.errors import InputError
from oneblock.finetune.examples import build_examples
from oneblock.finetune.records import read_data
from oneblock.finetune.tokenize import encode_record
from oneblock.text.tokenizer import ByteTokenizer


def trained_text(tokenizer, example) -> list[str]:
    """The trained stretches of an example, decoded."""
    runs, current = [], []
    for i, t in zip(example.ids, example.trained, strict=True):
        if t:
            current.append(i)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def test_chat_masks_only_assistant_answers_and_end_of_turn(tmp_path, smol_tokenizer):
    record = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello! How are you?"},
            {"role": "user", "content": "ok"},
            {"role": "assistant", "content": " Fine."},
        ]
    }
    data = read_data(write_jsonl(tmp_path / "c.jsonl", [record]))
    example = encode_record(data.records[0], smol_tokenizer)
    reference = smol_tokenizer.apply_chat_template(record["messages"], add_generation_prompt=False, tokenize=True)
    assert list(example.ids) == reference  # one tokenization of the whole rendering, as in chat
    assert trained_text(smol_tokenizer, example) == ["Hello! How are you?<|im_end|>", " Fine.<|im_end|>"]
    assert not example.trained[0]


def test_prompt_completion_and_alpaca_become_conversations(tmp_path, smol_tokenizer):
    pc = read_data(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2?", "completion": "4"}]))
    assert pc.format == "prompt-completion"
    alpaca_path = tmp_path / "a.json"
    alpaca_path.write_text(json.dumps([{"instruction": "Add", "input": "2 and 2", "output": "4"}]))
    alpaca = read_data(alpaca_path)
    assert alpaca.format == "alpaca"
    assert alpaca.records[0].messages[0] == {"role": "user", "content": "Add\n\n2 and 2"}
    for data in (pc, alpaca):
        assert trained_text(smol_tokenizer, encode_record(data.records[0], smol_tokenizer)) == ["4<|im_end|>"]


def test_prompt_completion_without_template_is_plain_text(tmp_path):
    data = read_data(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ab", "completion": "cd"}]))
    example = encode_record(data.records[0], ByteTokenizer())
    assert list(example.ids) == list(b"abcd")
    assert list(example.trained) == [False, False, True, True]


def test_text_file_trains_every_token_once(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("abcdefghij")
    examples = build_examples(read_data(path), ByteTokenizer(), seq_len=4, truncate=False)
    assert [bytes(e.ids) for e in examples] == [b"abcde", b"efghi", b"ij"]
    targets = [i for e in examples for i, t in zip(e.ids, e.trained, strict=True) if t]
    assert bytes(targets) == b"bcdefghij"


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (json.dumps(chat("a", "b")) + "\n{oops\n", r"d\.jsonl:2: the record is not JSON"),
        ('{"messages": [{"role": "user", "content": "a"}]}\n', r"d\.jsonl:1: the conversation has no assistant turn"),
        ('{"messages": [{"role": "robot", "content": "a"}]}\n', r"d\.jsonl:1: message 0 has the unknown role 'robot'"),
        ('{"text": "a"}\n', r"d\.jsonl:1: a record must be"),
        ("\n  \n", r"d\.jsonl' is empty"),
    ],
)
def test_bad_jsonl_is_refused_with_file_and_line(tmp_path, content, match):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(InputError, match=match):
        read_data(path)


def test_mixed_formats_and_bad_suffix_refused(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [chat("a", "b"), {"prompt": "a", "completion": "b"}])
    with pytest.raises(InputError, match=r"m\.jsonl:2: a prompt-completion record in a file of chat records"):
        read_data(path)
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(InputError, match=r"suffix '\.csv'; use \.jsonl"):
        read_data(tmp_path / "d.csv")
    with pytest.raises(InputError, match="does not exist"):
        read_data(tmp_path / "missing.jsonl")


def test_conversation_needs_a_template(tmp_path):
    data = read_data(write_jsonl(tmp_path / "c.jsonl", [chat("a", "b")]))
    with pytest.raises(InputError, match=r"c\.jsonl:1: a conversation needs a chat template"):
        encode_record(data.records[0], ByteTokenizer())


def test_long_examples_refused_or_truncated(tmp_path, smol_tokenizer):
    data = read_data(write_jsonl(tmp_path / "l.jsonl", [chat("hi", "word " * 50), chat("hi", "ok")]))
    with pytest.raises(InputError, match=r"1 of 2 examples are longer than seq_len 40 tokens .* truncate=True"):
        build_examples(data, smol_tokenizer, seq_len=40, truncate=False)
    examples = build_examples(data, smol_tokenizer, seq_len=40, truncate=True)
    assert [len(e.ids) <= 41 for e in examples] == [True, True]


def test_masking_that_leaves_nothing_trained_is_refused(tmp_path, smol_tokenizer):
    data = read_data(write_jsonl(tmp_path / "n.jsonl", [chat("a long question " * 20, "answer")]))
    with pytest.raises(InputError, match=r"no token of .*n\.jsonl is trained"):
        build_examples(data, smol_tokenizer, seq_len=20, truncate=True)


def test_a_record_too_long_for_the_chat_template_is_named_and_truncate_cuts_it(tmp_path, smol_tokenizer):
    from oneblock.cli.finetune import FLAG_NAMES
    from oneblock.cli.spelling import reword

    short = {"prompt": "Say it.", "completion": "word " * 200}
    big = {"prompt": "Say it.", "completion": "word " * 250_000}  # 1.25 MB
    path = write_jsonl(tmp_path / "big.jsonl", [short, big])
    told = r"/big\.jsonl:2: the record holds 1,250,007 characters, more than the 500,000 a chat template may render"
    with pytest.raises(InputError, match=told + r"; .* pass truncate=True") as caught:
        build_examples(read_data(path), smol_tokenizer, seq_len=16, truncate=False)
    assert "--truncate to cut it to --seq-len tokens" in reword(str(caught.value), FLAG_NAMES)
    cut = build_examples(read_data(path), smol_tokenizer, seq_len=48, truncate=True)
    assert [len(e.ids) for e in cut] == [49, 49] and cut[1].where.endswith("big.jsonl:2")
    assert cut[1].ids == cut[0].ids and cut[1].trained == cut[0].trained  # the window sees the same tokens
