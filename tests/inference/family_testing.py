"""The chat templates of four model families, short but faithful to the published ones, and tiny GGUF chat models
with a Llama-3-style or a Gemma-style vocabulary whose greedy reply is ``Hi!`` followed by the family's
end-of-turn token.

The vocabularies are the 256 byte-level tokens plus each family's special tokens (Llama 3's after the bytes, as
``<|begin_of_text|>`` follows its 128,000 text tokens; Gemma's first, as ``<pad>`` is 0 and ``<eos>`` 1), and the
files name the end of turn as llama.cpp's converter writes it: ``tokenizer.ggml.eot_token_id`` (Llama 3's
``<|eot_id|>``, Gemma's ``<end_of_turn>``) beside an ``eos_token_id`` that is not it (``<|end_of_text|>``,
``<eos>``), and Llama 3.1's ``eom_token_id`` (``<|eom_id|>``).

The model is a bigram decoder: its blocks add nothing, the one-hot embedding goes through the final norm, and the
head maps each token to its successor: the newline that ends the assistant header to ``H``, then ``i``, ``!``, the
end-of-turn token, and from there back to the newline, so a reply that does not stop at the end of its turn runs
on (``Hi!<|eot_id|>\\nHi!...``) until ``max_new_tokens``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

import oneblock as ob
from oneblock.io.gguf.tokenizer import byte_alphabet
from oneblock.io.gguf.write import save_gguf
from oneblock.io.gguf.writer import Entry

# Meta-Llama-3-8B-Instruct's template, verbatim.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen2.5-Instruct's ChatML template without its tools branch: a default system prompt when none is given.
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant") %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
# Gemma 3's template for text content: the system prompt opens the first user turn, the assistant is "model".
GEMMA = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {{- message['content'] | trim -}}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)
# Phi-3-mini-4k-instruct's template, verbatim: eos_token closes a conversation given without a generation prompt.
PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

REPLY = "Hi!"


@dataclass(frozen=True)
class Family:
    """A family's special tokens in vocabulary order and which of them the GGUF keys name."""

    name: str
    template: str
    specials: tuple[str, ...]
    specials_first: bool
    bos: str
    eos: str
    eot: str
    eom: str | None = None

    @property
    def tokens(self) -> list[str]:
        text = [byte_alphabet()[b] for b in range(256)]
        return [*self.specials, *text] if self.specials_first else [*text, *self.specials]

    def id(self, token: str) -> int:
        return self.tokens.index(token)


LLAMA3_VOCAB = Family(
    "llama3", LLAMA3,
    ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
     "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"),
    specials_first=False, bos="<|begin_of_text|>", eos="<|end_of_text|>", eot="<|eot_id|>", eom="<|eom_id|>",
)  # fmt: skip
GEMMA_VOCAB = Family(
    "gemma", GEMMA,
    ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[@BOS@]", "<start_of_turn>", "<end_of_turn>"),
    specials_first=True, bos="<bos>", eos="<eos>", eot="<end_of_turn>",
)  # fmt: skip


def bigram_model(family: Family) -> ob.Decoder:
    """The decoder whose greedy continuation of a generation prompt is ``Hi!`` then the end-of-turn token."""
    tokens = family.tokens
    v = len(tokens)  # 264: two heads of 132
    cfg = ob.ModelConfig(
        vocab_size=v, d_model=v, n_heads=2, n_layers=1, d_ff=8, max_seq_len=256, norm="rmsnorm", ffn="swiglu",
        position="rope", bias=False, tie_embeddings=False,
    )  # fmt: skip
    model = ob.build_model(cfg)
    newline = family.id(byte_alphabet()[ord("\n")])
    chain = [newline, *(family.id(byte_alphabet()[b]) for b in REPLY.encode()), family.id(family.eot), newline]
    successor = dict.fromkeys(range(v), family.id(family.eot)) | dict(itertools.pairwise(chain))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0 if p.dim() == 1 else 0.0)  # norms' gains 1, every matrix 0
        model.embed.tok.weight.copy_(torch.eye(v))
        for token, following in successor.items():
            model.lm_head.weight[following, token] = 1.0
    return model.eval()


def write_family_gguf(directory: Path, family: Family) -> Path:
    """The tiny chat model of ``family`` as a GGUF file with its vocabulary, special ids and chat template."""
    tokens = family.tokens
    types = [3 if t in family.specials else 1 for t in tokens]  # 3: control tokens, matched whole
    u32, boolean, string, array, int32 = 4, 7, 8, 9, 5
    ids = [("bos", family.bos), ("eos", family.eos), ("eot", family.eot)]
    ids += [("eom", family.eom)] if family.eom is not None else []
    vocabulary = [
        Entry("tokenizer.ggml.model", "gpt2", string),
        Entry("tokenizer.ggml.pre", "llama-bpe", string),
        Entry("tokenizer.ggml.tokens", tokens, array, string),
        Entry("tokenizer.ggml.token_type", types, array, int32),
        *(Entry(f"tokenizer.ggml.{key}_token_id", family.id(token), u32) for key, token in ids),
        Entry("tokenizer.ggml.add_bos_token", False, boolean),
        Entry("tokenizer.chat_template", family.template, string),
    ]
    return save_gguf(bigram_model(family), directory / f"{family.name}.gguf", vocabulary=vocabulary)
