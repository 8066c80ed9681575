"""The Hermes / Qwen tool format: a template that reads ``tools`` and writes ``<tool_call>`` blocks (Hermes 2 and 3,
Qwen 2.5 and 3, and most templates with tools). The model answers with text, or with one or several blocks

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

a newline between blocks. The template renders the calls and the results itself (``tool_template``).
"""

from __future__ import annotations

import re
from typing import Any

from oneblock import jsontext
from oneblock.inference.constraints import lark_literal
from oneblock.serve.template_format import Answer, TemplateFormat, json_alternatives, openai_call, start_rule
from oneblock.serve.tools import Tools

HERMES = "hermes"
TAGS = ("<tool_call>", "</tool_call>")
BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def is_hermes(template: str) -> bool:
    """Whether the template writes ``<tool_call>`` blocks."""
    return "<tool_call>" in template


def hermes_grammar(tools: Tools, tokenizer: Any = None) -> str:
    """The Lark grammar of an answer: text (not beginning with ``<``), calls, or either, as ``tool_choice``
    allows; several calls (one per block, a newline between blocks) unless ``parallel_tool_calls`` is false. The
    tags are spelled as tokens where the vocabulary holds them whole (a vocabulary may hold them as special tokens)."""
    schemas = tools.call_schemas()
    lines = ["TEXT: /[^<](?s:.)*/"]
    if schemas:
        lines.append("calls: call" + ("" if not tools.parallel else ' ("\\n" call)*'))
        opening, closing = (lark_literal(tokenizer, t) for t in TAGS)
        lines.append(f'call: {opening} "\\n" body "\\n" {closing}')
        lines += json_alternatives("body", schemas)
    return "\n".join([start_rule(tools), *lines]) + "\n"


def read_hermes(text: str, tools: Tools) -> Answer:
    """An answer's ``(content, tool_calls)``: an answer that is ``<tool_call>`` blocks from its start (where the
    grammar puts them) as calls in OpenAI's shape (ids made here, arguments as JSON text), each of a function
    ``tools`` allows; any other text (tags after text, a block cut short, an undeclared function, anything
    under ``tool_choice: "none"``) as it stands."""
    if tools.choice == "none" or not text.startswith(TAGS[0]) or BLOCK.sub("", text).strip():
        return text, None
    calls = []
    for block in BLOCK.finditer(text):
        try:
            call = jsontext.loads(block.group(1), what="a tool call")
        except ValueError:
            return text, None
        if not (isinstance(call, dict) and tools.allows(call.get("name"), call.get("arguments"))):
            return text, None
        calls.append(openai_call(call["name"], call["arguments"]))
    return None, calls


HERMES_FORMAT = TemplateFormat(HERMES, is_hermes, hermes_grammar, read_hermes)
