"""Chat templates of four families render as ``transformers``' ``apply_chat_template`` renders the same template
string: Llama 3's header ids, ChatML, Gemma's ``<start_of_turn>user``/``model`` turns and Phi-3's tags, with and
without a system message and a generation prompt."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from family_testing import CHATML, GEMMA, LLAMA3, PHI3  # noqa: E402

from oneblock.errors import InputError  # noqa: E402
from oneblock.text.chat_template import render_chat  # noqa: E402

# (template, special tokens as the family's tokenizer_config.json names them)
FAMILIES = {
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "chatml": (CHATML, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "gemma": (GEMMA, {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}),
    "phi3": (PHI3, {"bos_token": "<s>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}),
}
SYSTEM = {"role": "system", "content": "You answer in French."}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "  What is 2 + 2?\n"}],  # spaces that a template's trim removes
    "system": [SYSTEM, {"role": "user", "content": "Name a colour."}],
    "turns": [
        SYSTEM,
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": " Bleu. "},
        {"role": "user", "content": 'And "another", with an accent: café?'},
    ],
}


def transformers_tokenizer(template: str, specials: dict[str, str]):
    """A ``PreTrainedTokenizerFast`` that only carries the template and the special tokens' strings."""
    vocab = {"<unk>": 0, **{token: i + 1 for i, token in enumerate(dict.fromkeys(specials.values()))}}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", **specials)
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_render_chat_equals_transformers(family, conversation, add_generation_prompt):
    template, specials = FAMILIES[family]
    messages = CONVERSATIONS[conversation]
    theirs = transformers_tokenizer(template, specials).apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    ours = render_chat(messages, template=template, add_generation_prompt=add_generation_prompt, **specials)
    assert ours == theirs


def test_the_families_turns_as_published():
    """What the four renderings are, written out: a wrong fixture would agree with transformers too."""
    messages = CONVERSATIONS["system"]

    def rendered(family: str) -> str:
        template, specials = FAMILIES[family]
        return render_chat(messages, template=template, **specials)

    assert rendered("llama3") == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou answer in French.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nName a colour.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert rendered("chatml") == (
        "<|im_start|>system\nYou answer in French.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert rendered("gemma") == (
        "<bos><start_of_turn>user\nYou answer in French.\n\nName a colour.<end_of_turn>\n<start_of_turn>model\n"
    )
    assert (
        rendered("phi3") == "<|system|>\nYou answer in French.<|end|>\n<|user|>\nName a colour.<|end|>\n<|assistant|>\n"
    )
    template, specials = FAMILIES["phi3"]
    closed = render_chat(messages, template=template, add_generation_prompt=False, **specials)
    assert closed.endswith("Name a colour.<|end|>\n<|endoftext|>")  # no generation prompt: eos_token closes it
    template, specials = FAMILIES["chatml"]
    default = render_chat(CONVERSATIONS["user"], template=template)
    assert default.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")


def test_gemma_refuses_roles_that_do_not_alternate_as_transformers_does():
    template, specials = FAMILIES["gemma"]
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="Conversation roles must alternate"):
        transformers_tokenizer(template, specials).apply_chat_template(messages, tokenize=False)
    with pytest.raises(InputError, match="rejected the conversation: Conversation roles must alternate"):
        render_chat(messages, template=template, **specials)


# Mistral-7B-Instruct-v0.3's way of listing tools, cut to its tests of `tools` and `documents`.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages %}{%- if message['role'] == 'user' %}"
    "{%- if tools is not none and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- if documents is not none %}[DOCS]{{ documents | length }}[/DOCS]{%- endif %}"
    "[INST] {{ message['content'] }}[/INST]{%- else %}{{ message['content'] + eos_token }}{%- endif %}{%- endfor %}"
)


@pytest.mark.parametrize("tools", [None, [{"type": "function", "function": {"name": "now", "parameters": {}}}]])
def test_tools_and_documents_are_none_unless_given_as_in_transformers(tools):
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    messages = CONVERSATIONS["user"]
    theirs = transformers_tokenizer(TOOLS_TEMPLATE, specials).apply_chat_template(messages, tools=tools, tokenize=False)
    ours = render_chat(messages, template=TOOLS_TEMPLATE, **specials, **({} if tools is None else {"tools": tools}))
    assert ours == theirs
    assert ("[AVAILABLE_TOOLS]" in ours) == (tools is not None) and "[DOCS]" not in ours
