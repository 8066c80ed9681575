"""The Llama 3.x JSON tool format (Llama 3.1, 3.2 and 3.3's templates), found as llama.cpp finds it: the template
reads ``tools`` and writes tool results under an ``ipython`` header (or knows ``<|python_tag|>``, the tag of the
built-in tools), and is not Functionary's (Llama 3.1's template with calls of its own, ``<function=...>`` or
``>>>name``, which this server does not read). The model answers with text, or with one JSON object

    {"name": "get_weather", "parameters": {"city": "Paris"}}

("parameters", as the template writes earlier calls; "arguments" is read too). The template renders earlier calls
from an assistant message's ``tool_calls`` (one per message: it raises for more) and a ``tool`` message as an
``ipython`` turn.

One call per answer: these templates (and the models trained on them) know no parallel calls, so an answer holds
at most one call whatever ``parallel_tool_calls`` says.
"""

from __future__ import annotations

from typing import Any

from oneblock import jsontext
from oneblock.serve.template_format import (
    Answer,
    TemplateFormat,
    json_alternatives,
    openai_call,
    renamed_schema,
    start_rule,
)
from oneblock.serve.tools import Tools

LLAMA3 = "llama3"
IPYTHON = "<|start_header_id|>ipython<|end_header_id|>"
PYTHON_TAG = "<|python_tag|>"
FUNCTIONARY = ("<function=", ">>>all")  # Functionary's calls, in templates otherwise Llama 3.1's


def is_llama3(template: str) -> bool:
    """Whether the template writes tool results under an ``ipython`` header or knows ``<|python_tag|>``, and writes
    no Functionary calls."""
    return (IPYTHON in template or PYTHON_TAG in template) and not any(m in template for m in FUNCTIONARY)


def llama3_grammar(tools: Tools, tokenizer: Any = None) -> str:
    """The Lark grammar of an answer: text (beginning with neither ``{`` nor a space), one call object, or
    either, as ``tool_choice`` allows."""
    schemas = [renamed_schema(s, "parameters") for s in tools.call_schemas()]
    lines = ["TEXT: /[^{\\s](?s:.)*/"]
    if schemas:
        lines.append("calls: call")  # one call: the format has no parallel calls
        lines += json_alternatives("call", schemas)
    return "\n".join([start_rule(tools), *lines]) + "\n"


def read_llama3(text: str, tools: Tools) -> Answer:
    """An answer's ``(content, tool_calls)``: an answer that is one JSON object ``{"name", "parameters"}`` (or
    ``"arguments"``) from its first character (where the grammar puts a call; text may begin with neither ``{``
    nor a space), a call of a function ``tools`` allows, as one call in OpenAI's shape (``content`` ``None``); any
    other text (``<|python_tag|>`` and an object, which the grammar never writes, an object cut short or of
    another shape, an undeclared function, anything under ``tool_choice: "none"``) as it stands."""
    if tools.choice == "none" or not text.startswith("{"):
        return text, None
    try:
        call = jsontext.loads(text, what="a tool call")
    except ValueError:
        return text, None
    arguments = call.get("parameters", call.get("arguments")) if isinstance(call, dict) else None
    if not isinstance(call, dict) or not tools.allows(call.get("name"), arguments):
        return text, None
    return None, [openai_call(call["name"], arguments)]


LLAMA3_FORMAT = TemplateFormat(LLAMA3, is_llama3, llama3_grammar, read_llama3)
