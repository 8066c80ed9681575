"""Tools in the chat template's own format (``oneblock.serve.tool_template``): which template gets which format,
and the Hermes format on the tiny model with a small byte-level BPE whose chat template is Hermes-style (it reads
``tools`` and writes ``<tool_call>`` blocks), through the ``openai`` client: the template renders the tools and
the earlier calls and results, a constrained answer is read into ``tool_calls``, the round trip ends in an answer;
a template without ``tools`` is served in the generic format. Mistral's and Llama 3's formats:
``test_tool_mistral.py``, ``test_tool_llama3.py``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
from serve_testing import Running
from tool_testing import (
    AUTO,
    DAY,
    NONE,
    QUESTION,
    RESULT,
    TIME,
    ask,
    check_call,
    check_choices,
    check_grammar,
    check_streamed_calls,
    round_trip,
    trained_tokenizer,
)
from tool_testing import serve as serve_format

from oneblock.serve.prompts import chat_prompt
from oneblock.serve.tool_hermes import hermes_grammar, read_hermes
from oneblock.serve.tool_template import GENERIC, HERMES, LLAMA3, MISTRAL, tool_format
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
OPENAI_ID = re.compile(r"call_[0-9a-f]{24}")


def serve(template: str) -> Running:
    return serve_format(template, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])


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


def test_each_template_gets_its_format_by_its_markers():
    assert tool_format(HERMES_TEMPLATE) == HERMES
    assert tool_format(PLAIN_TEMPLATE) == GENERIC and tool_format(None) == GENERIC and tool_format("") == GENERIC
    reads = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
    assert tool_format(reads + "[TOOL_CALLS][{{ call | tojson }}]") == MISTRAL
    assert tool_format(reads + "<|start_header_id|>ipython<|end_header_id|>\n\n") == LLAMA3
    assert tool_format(reads + "<|python_tag|>{{ call | tojson }}") == LLAMA3
    # Functionary's Llama 3.1 templates write calls of their own
    assert tool_format(reads + "<|start_header_id|>ipython<|end_header_id|><function={{ name }}>") == GENERIC
    assert tool_format(reads + "<|start_header_id|>ipython<|end_header_id|>>>>all\n") == GENERIC
    # the markers without reading tools are no tool format (a template that cannot show the tools)
    assert tool_format("[TOOL_CALLS]{{ messages }}") == GENERIC
    assert tool_format("<|start_header_id|>ipython<|end_header_id|>{{ messages }}") == GENERIC
    # reads tools but writes calls in a format this server does not know: the generic one, Mistral's later
    # "[TOOL_CALLS]name[ARGS]{...}" included
    assert tool_format(reads + "[CALLS]") == GENERIC
    assert tool_format(reads + "[TOOL_CALLS]{{ name }}[ARGS]{{ arguments }}") == GENERIC


def test_smollm2s_template_has_no_tool_format():
    from oneblock.inference.smollm2 import smollm2_gguf_path
    from oneblock.io.gguf.tokenizer import GGUFTokenizer

    template = GGUFTokenizer.from_gguf(smollm2_gguf_path()).chat_template
    assert template and "<|im_start|>" in template
    assert tool_format(template) == GENERIC


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


def test_tool_choice_in_its_four_forms(hermes):
    check_choices(hermes, OPENAI_ID, "<", parallel=True)
    [choice] = ask(hermes, tool_choice="required", parallel_tool_calls=False, n=1, seed=8).choices
    [call] = choice.message.tool_calls  # one block with parallel_tool_calls false
    check_call(call)


@pytest.mark.parametrize("tags", ["text", "special tokens"])
def test_the_grammar_lets_text_or_valid_blocks_through(tags):
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    day = '<tool_call>\n{"name": "get_day", "arguments": {"short": true}}\n</tool_call>'
    good = ["It is noon.", call, call + "\n" + day]
    bad = [
        call.replace("UTC", "PST"),  # not valid against the schema
        call.replace("get_time", "get_week"),  # no such tool
        call.replace('", "', '",  "'),  # not json.dumps's layout
        call + day,  # no newline between blocks
        "<hello>",  # text beginning like a block
    ]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    if tags == "special tokens":  # as a vocabulary may hold them
        specials += ["<tool_call>", "</tool_call>"]
    tokenizer = trained_tokenizer(HERMES_TEMPLATE, specials)
    check_grammar(tokenizer, hermes_grammar, good, bad)


def test_a_streamed_call_equals_the_whole_one(hermes):
    check_streamed_calls(hermes, OPENAI_ID)


def test_the_round_trip_with_the_openai_client(hermes):
    def written(call):
        block = f'<tool_call>\n{{"name": "{call.function.name}", "arguments": {call.function.arguments}}}\n</tool_call>'
        return f"<|im_start|>assistant\n{block}\n<|im_end|>\n<|im_start|>user\n<tool_response>\n{RESULT}\n"

    round_trip(hermes, OPENAI_ID, written)


def test_several_blocks_are_read_and_only_where_the_grammar_puts_calls():
    calls_text = ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
                  '<tool_call>\n{"name": "get_day", "arguments": {"short": true}}\n</tool_call>')  # fmt: skip
    content, calls = read_hermes(calls_text, AUTO)
    assert content is None and calls is not None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {"zone": "UTC"}), ("get_day", {"short": True})
    ]  # fmt: skip
    assert len({c["id"] for c in calls}) == 2
    cut = '<tool_call>\n{"name": "get_time", "arguments": {"zo'
    for text in (
        cut,  # cut short
        "Hello",  # text
        '<tool_call>\n{"name": "get_time"}\n</tool_call>',  # no arguments
        '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "get_time", "arguments": {}} x\n</tool_call>',  # not JSON
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_day", "a',
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # a required argument missing
        '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>',  # not a declared tool
        "Sure.\n" + calls_text,  # text that goes on to spell calls: the grammar allows calls only at the start
        calls_text + "\nDone.",  # text after the calls
    ):
        assert read_hermes(text, AUTO) == (text, None), text
    assert read_hermes(calls_text, NONE) == (calls_text, None)  # tool_choice "none": never a call
    only_day = parse_tools({"tools": [TIME, DAY], "tool_choice": {"type": "function", "function": {"name": "get_day"}}})
    # a call of get_time, which the choice does not allow
    assert read_hermes(calls_text, only_day) == (calls_text, None)


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


def test_a_pydantic_tool_with_nested_models_is_called_with_valid_arguments(hermes, plain):
    """``openai.pydantic_function_tool`` sends ``$defs`` and ``"$ref": "#/$defs/Zone"``: the references are
    rewritten to resolve inside the call's schema, in a template's format and in the generic one."""
    from typing import Literal

    import openai
    import pydantic

    class Zone(pydantic.BaseModel):
        name: Literal["UTC", "CET"]

    class AskTime(pydantic.BaseModel):
        zone: Zone
        short: bool

    tool = openai.pydantic_function_tool(AskTime, name="ask_time")
    assert "$defs" in tool["function"]["parameters"]  # the shape that nested in a call schema would not resolve
    for running, limit in ((hermes, 160), (plain, 200)):
        answer = ask(running, tools=[tool, TIME], tool_choice="required", parallel_tool_calls=False, n=3,
                     max_tokens=limit)  # fmt: skip
        for choice in answer.choices:
            assert choice.finish_reason == "tool_calls", choice
            [call] = choice.message.tool_calls
            if call.function.name == "ask_time":
                AskTime.model_validate_json(call.function.arguments)  # raises on arguments that do not validate
            else:
                check_call(call)
        named = {"type": "function", "function": {"name": "ask_time"}}
        [call] = (
            ask(running, tools=[tool], tool_choice=named, parallel_tool_calls=False, max_tokens=limit)
            .choices[0]
            .message.tool_calls
        )
        assert call.function.name == "ask_time"
        assert isinstance(AskTime.model_validate_json(call.function.arguments).zone, Zone)
