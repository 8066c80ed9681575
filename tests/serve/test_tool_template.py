"""Tools in the chat template's own format (``oneblock.serve.tool_template``), on the tiny model with a small
byte-level BPE whose chat template is Hermes-style (it reads ``tools`` and writes ``<tool_call>`` blocks), through
the ``openai`` client: the template renders the tools and the earlier calls and results, a constrained answer is
read into ``tool_calls``; a template without ``tools`` is served in the generic format."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from serve_testing import Running, tiny_model

from oneblock.io.gguf.tokenizer import GGUFTokenizer
from oneblock.serve.engine import Engine
from oneblock.serve.prompts import chat_prompt
from oneblock.serve.tool_template import GENERIC, HERMES, read_hermes, tool_format
from oneblock.serve.tools import parse_tools

HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
PLAIN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TIME = {
    "type": "function",
    "function": {
        "name": "get_time", "description": "The current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                       "required": ["zone"], "additionalProperties": False},
    },
}  # fmt: skip
DAY = {
    "type": "function",
    "function": {
        "name": "get_day", "description": "Today's day of the week",
        "parameters": {"type": "object", "properties": {"short": {"type": "boolean"}}, "required": ["short"],
                       "additionalProperties": False},
    },
}  # fmt: skip
QUESTION = [{"role": "user", "content": "What time is it in Paris?"}]
VOCAB = 640  # the model's ids; the tokenizer has at most 600


def tokenizer(template: str) -> GGUFTokenizer:
    """A byte-level BPE trained here on the tools' words, ``<|endoftext|>`` (id 0) ending an answer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    corpus = [HERMES_TEMPLATE, json.dumps(TIME), json.dumps(DAY), '<tool_call>\n{"name": "get_time", "arguments": '
              '{"zone": "UTC"}}\n</tool_call>', "What time is it in Paris?"] * 20  # fmt: skip
    tok.train_from_iterator(corpus, trainer)
    return GGUFTokenizer(tok, bos_id=None, eos_id=0, chat_template=template, name="trained")


def serve(template: str) -> Running:
    return Running(Engine(tiny_model(vocab_size=VOCAB, max_seq_len=1024), tokenizer(template), max_batch=4))


@pytest.fixture(scope="module")
def hermes() -> Iterator[Running]:
    running = serve(HERMES_TEMPLATE)
    yield running
    running.close()


@pytest.fixture(scope="module")
def plain() -> Iterator[Running]:
    running = serve(PLAIN_TEMPLATE)
    yield running
    running.close()


def ask(running, messages=QUESTION, **options):
    client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=120)
    options = {"temperature": 1.0, "seed": 3, "max_tokens": 160, "tools": [TIME, DAY], **options}
    return client.chat.completions.create(model="m", messages=messages, **options)


def check_call(call) -> None:
    """A call of TIME or DAY whose arguments are valid against its schema."""
    arguments = json.loads(call.function.arguments)
    assert call.type == "function" and call.id.startswith("call_")
    if call.function.name == "get_time":
        assert set(arguments) == {"zone"} and arguments["zone"] in ("UTC", "CET"), arguments
    else:
        assert call.function.name == "get_day" and set(arguments) == {"short"}
        assert isinstance(arguments["short"], bool)


def test_the_format_is_the_templates_when_it_reads_tools_and_writes_tool_call_blocks():
    assert tool_format(HERMES_TEMPLATE) == HERMES
    assert tool_format(PLAIN_TEMPLATE) == GENERIC and tool_format(None) == GENERIC
    # reads tools but writes calls in a format this server does not know: the generic one
    assert tool_format("{% for tool in tools %}{{ tool | tojson }}{% endfor %}[CALLS]") == GENERIC


def test_the_template_renders_the_tools_the_calls_and_the_results(hermes):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "14:05"}]  # fmt: skip
    body = {"messages": messages, "tools": [TIME, DAY], "tool_choice": "auto"}
    tok = hermes.engine.tokenizer
    ids = chat_prompt(body, tok, parse_tools(body)).ids
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>\n")
    listed = text[text.index("<tools>\n") + 8 : text.index("</tools>")].splitlines()
    assert [json.loads(line) for line in listed] == [TIME, DAY]  # the tools, as the client sent them
    call_block = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    assert "<|im_start|>assistant\n" + call_block in text
    assert "<|im_start|>user\n<tool_response>\n14:05\n</tool_response><|im_end|>" in text
    assert "You can call these tools" not in text  # not the generic format
    assert text.endswith("<|im_start|>assistant\n")
    # the server renders the same prompt: its prompt_tokens count these ids
    answer = ask(hermes, messages, tool_choice="auto", max_tokens=4)
    assert answer.usage.prompt_tokens == len(ids)


def test_a_constrained_answer_is_read_as_tool_calls(hermes):
    answer = ask(hermes, tool_choice="required", parallel_tool_calls=False, n=4)
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        [call] = choice.message.tool_calls
        check_call(call)
    named = ask(hermes, tool_choice={"type": "function", "function": {"name": "get_day"}}, parallel_tool_calls=False)
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_day" and named.choices[0].finish_reason == "tool_calls"
    check_call(call)


def test_a_streamed_call_equals_the_whole_one(hermes):
    options = {"tool_choice": "required", "parallel_tool_calls": False, "temperature": 0}
    whole = ask(hermes, **options).choices[0]
    calls, finish = {}, None
    for chunk in ask(hermes, stream=True, **options):
        for call in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" == whole.finish_reason
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]


def test_none_answers_with_text(hermes):
    answer = ask(hermes, tool_choice="none", max_tokens=24, n=3)
    for choice in answer.choices:
        assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
        assert choice.message.content and not choice.message.content.startswith("<")


def test_several_blocks_and_text_before_them_are_read():
    text = ('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_day", "arguments": {"short": true}}\n</tool_call>')  # fmt: skip
    content, calls = read_hermes(text)
    assert content == "Let me check." and calls is not None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {"zone": "UTC"}), ("get_day", {"short": True})
    ]  # fmt: skip
    assert len({c["id"] for c in calls}) == 2
    cut = '<tool_call>\n{"name": "get_time", "arguments": {"zo'
    assert read_hermes(cut) == (cut, None) and read_hermes("Hello") == ("Hello", None)


def test_a_template_without_tools_uses_the_generic_format(plain):
    body = {"messages": QUESTION, "tools": [TIME, DAY]}
    tok = plain.engine.tokenizer
    text = tok.decode(chat_prompt(body, tok, parse_tools(body)).ids)
    assert text.startswith("<|im_start|>system\nYou can call these tools: ") and "<tool_call>" not in text
    answer = ask(plain, tool_choice="required", parallel_tool_calls=False, n=2, max_tokens=200)
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        check_call(call)
