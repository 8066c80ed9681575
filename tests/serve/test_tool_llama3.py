"""The Llama 3.x JSON tool format (``oneblock.serve.tool_llama3``) on the tiny model, whose chat template is a
short copy of Llama 3.1's tool handling (the tools in the first user message, a call as one JSON object with
"parameters", a result as an ``ipython`` turn, one call per message), through the ``openai`` client."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from serve_testing import Running
from tool_testing import (
    AUTO,
    DAY,
    NONE,
    OPENAI_ID,
    QUESTION,
    RESULT,
    TIME,
    ask,
    check_choices,
    check_grammar,
    check_streamed_calls,
    round_trip,
    serve,
)

from oneblock.serve.prompts import chat_prompt
from oneblock.serve.tool_llama3 import llama3_grammar, read_llama3
from oneblock.serve.tool_template import LLAMA3, tool_format
from oneblock.serve.tools import parse_tools

# Llama 3.1's template, its tool handling kept (built-in tools and dates left out).
LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}{{- "Environment: ipython\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"""
SPECIALS = ["<|eot_id|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>"]


@pytest.fixture(scope="module")
def llama3() -> Iterator[Running]:
    running = serve(LLAMA3_TEMPLATE, SPECIALS, bos=True)
    yield running
    running.close()


def test_the_template_is_llama3s():
    assert tool_format(LLAMA3_TEMPLATE) == LLAMA3


def test_the_template_renders_the_tools_the_call_and_the_result(llama3):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}
    messages = [{"role": "system", "content": "You tell the time."}, *QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": RESULT}]  # fmt: skip
    body = {"messages": messages, "tools": [TIME, DAY], "tool_choice": "auto"}
    tok = llama3.engine.tokenizer
    ids = chat_prompt(body, tok, parse_tools(body)).ids
    listed = "".join(json.dumps(t, indent=4) + "\n\n" for t in (TIME, DAY))
    assert tok.decode(ids) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
        "Cutting Knowledge Date: December 2023\n\nYou tell the time.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON for a "
        "function call with its proper arguments that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
        f"Do not use variables.\n\n{listed}What time is it in Paris?<|eot_id|>"
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_time", "parameters": {"zone": "CET"}}'
        f'<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n"{RESULT}"<|eot_id|>'  # the template quotes it
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    answer = ask(llama3, messages, tool_choice="auto", max_tokens=4)
    assert answer.usage.prompt_tokens == len(ids)  # the server renders the same prompt


def test_two_calls_in_one_message_are_refused_by_the_template(llama3):
    calls = [{"id": f"call_{k}", "type": "function", "function": {"name": "get_day", "arguments": '{"short": true}'}}
             for k in range(2)]  # fmt: skip
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": calls}]
    with pytest.raises(Exception, match="only supports single tool-calls") as caught:
        ask(llama3, messages)
    assert getattr(caught.value, "status_code", None) == 400


def test_tool_choice_in_its_four_forms_one_call_an_answer(llama3):
    check_choices(llama3, OPENAI_ID, "{", parallel=False)  # parallel_tool_calls true (the default): still one


def test_the_grammar_allows_one_call_whatever_parallel_tool_calls_says():
    for parallel in (True, False):
        body = {"tools": [TIME, DAY], "tool_choice": "required", "parallel_tool_calls": parallel}
        grammar = llama3_grammar(parse_tools(body))
        assert grammar.startswith("start: calls\n") and "calls: call\n" in grammar
        assert '"parameters"' in grammar and '"arguments"' not in grammar
    none = llama3_grammar(parse_tools({"tools": [TIME], "tool_choice": "none"}))
    assert none == "start: TEXT\nTEXT: /[^{\\s](?s:.)*/\n"


def test_the_grammar_lets_text_or_one_valid_call_through(llama3):
    call = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
    good = ["It is noon.", call, '{"name": "get_day", "parameters": {"short": false}}']
    bad = [
        call.replace("UTC", "PST"),  # not valid against the schema
        call.replace("parameters", "arguments"),  # read, but not what the template writes
        call + call,  # two calls
        call + "; " + call,
        " " + call,  # text beginning with a space, then a call no schema checked
        "{is it noon?}",
    ]
    check_grammar(llama3.engine.tokenizer, llama3_grammar, good, bad)


def test_a_streamed_call_equals_the_whole_one(llama3):
    check_streamed_calls(llama3, OPENAI_ID)


def test_the_round_trip_with_the_openai_client(llama3):
    def written(call):
        head = "<|start_header_id|>assistant<|end_header_id|>\n\n"
        result = f'<|start_header_id|>ipython<|end_header_id|>\n\n"{RESULT}"<|eot_id|>'
        return f'{head}{{"name": "{call.function.name}", "parameters": {call.function.arguments}}}<|eot_id|>{result}'

    round_trip(llama3, OPENAI_ID, written)


def test_the_reader_takes_one_call_or_the_text():
    content, calls = read_llama3('{"name": "get_time", "parameters": {"zone": "UTC"}}', AUTO)
    assert content is None and calls is not None
    [call] = calls
    assert OPENAI_ID.fullmatch(call["id"]) and call["type"] == "function"
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    # "arguments" as well
    content, calls = read_llama3('{"name": "get_day", "arguments": {"short": false}}', AUTO)
    assert content is None and calls is not None
    assert calls[0]["function"] == {"name": "get_day", "arguments": '{"short": false}'}
    assert read_llama3('{"name": "get_time", "parameters": {"zone": "UTC"}}', NONE)[1] is None  # never under none
    for text in (
        "It is 14:05.",  # text
        '{"name": "get_time", "parameters": {"zo',  # cut short
        '{"name": "get_time"}',  # no arguments
        '{"name": 3, "parameters": {}}',  # no name
        '{"name": "get_time", "parameters": "UTC"}',  # arguments not an object
        '[{"name": "get_time", "parameters": {}}]',  # a list
        '{"name": "get_time", "parameters": {}} and more',  # text after the object
        '{"name": "delete_everything", "parameters": {}}',  # not a declared tool
        '<|python_tag|>{"name": "get_day", "arguments": {"short": false}}',  # the grammar writes no tag
        ' {"name": "get_day", "arguments": {"short": false}}',  # nor a space before a call
        'Text first. {"name": "get_day", "arguments": {"short": false}}',
    ):
        assert read_llama3(text, AUTO) == (text, None), text
