"""``ChatSession`` on chat models whose turn ends with their family's own token, not their end-of-text id: Llama 3's
``<|eot_id|>`` (its eos is ``<|end_of_text|>``) and Gemma's ``<end_of_turn>`` (its eos ``<eos>``), read from the
GGUF file's ``tokenizer.ggml.eot_token_id``. The models (``family_testing``) answer ``Hi!`` and then that token, and
would run on past it."""

from __future__ import annotations

import pytest

pytest.importorskip("gguf")
pytest.importorskip("jinja2")

from family_testing import GEMMA_VOCAB, LLAMA3_VOCAB, REPLY, write_family_gguf

from oneblock.inference.chat import ChatSession
from oneblock.inference.load import load_model


@pytest.mark.parametrize("family", [LLAMA3_VOCAB, GEMMA_VOCAB], ids=lambda f: f.name)
def test_a_reply_ends_at_the_end_of_turn_token(tmp_path, family):
    loaded = load_model(write_family_gguf(tmp_path, family))
    tok = loaded.tokenizer
    assert tok.eos_id == family.id(family.eos) != family.id(family.eot)
    session = ChatSession(loaded.model, tok, system="Be brief.", max_new_tokens=12)
    assert session.send("Hello") == REPLY
    reply = session.last
    assert reply is not None and reply.finished and tok.decode(reply.ids) == REPLY and len(reply.ids) == 3
    assert "".join(session.stream("Again")) == REPLY and session.last.finished  # the second turn ends there too
    assert [m["content"] for m in session.history] == ["Hello", REPLY, "Again", REPLY]
