"""Tool calling in the chat template's own format, when the template has one (the Hermes / Qwen style).

A template has a tool format when it reads the ``tools`` variable (Hugging Face's convention,
``apply_chat_template(messages, tools=[...])``) and writes calls as ``<tool_call>`` blocks, as Hermes, Qwen 2.5 and
3 and most templates with tools do: the model answers with text, or with one or several blocks

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Such a conversation is rendered by the template itself: the tools as its ``tools`` variable (OpenAI's list is
already Hugging Face's shape), an assistant message's ``tool_calls`` with their arguments as objects, a ``tool``
message with its ``tool_call_id`` and the called function's ``name``. The answer is constrained by an llguidance
Lark grammar to plain text (not beginning with ``<``) or such blocks, each block's JSON valid against its
function's schema (``Tools.call_schemas``). A template that reads ``tools`` but writes no ``<tool_call>`` has a
format this server cannot read; it is served in the generic format (``oneblock.serve.tools``).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from oneblock import jsontext
from oneblock.inference.constraints import JSON_LAYOUT
from oneblock.serve.tools import Tools

HERMES = "hermes"
GENERIC = "generic"
READS_TOOLS = re.compile(r"\btools\b")
BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def tool_format(template: str | None) -> str:
    """``"hermes"`` for a chat template that reads ``tools`` and writes ``<tool_call>`` blocks, else ``"generic"``."""
    if template and READS_TOOLS.search(template) and "<tool_call>" in template:
        return HERMES
    return GENERIC


def template_calls(calls: list[Any]) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` (checked OpenAI shape) as templates read them: arguments as objects
    (JSON text that does not parse stays text)."""
    out = []
    for call in calls:
        function = call["function"]
        try:
            arguments: Any = jsontext.loads(function["arguments"], what="a tool call's arguments")
        except ValueError:
            arguments = function["arguments"]
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})  # fmt: skip
    return out


def hermes_grammar(tools: Tools) -> str:
    """The Lark grammar (llguidance's dialect) of an answer: text, calls, or either, as ``tool_choice`` allows;
    several calls (one per block, a newline between blocks) unless ``parallel_tool_calls`` is false."""
    schemas = tools.call_schemas()
    lines = ["TEXT: /[^<](?s:.)*/"]
    if schemas:
        lines.append("calls: call" + ("" if not tools.parallel else ' ("\\n" call)*'))
        lines.append("call: " + " | ".join(f"call_{k}" for k in range(len(schemas))))
        for k, schema in enumerate(schemas):
            body = json.dumps({**schema, "x-guidance": JSON_LAYOUT})
            lines.append(f'call_{k}: "<tool_call>\\n" %json {body} "\\n</tool_call>"')
    start = {"none": "TEXT", "auto": "TEXT | calls"}.get(tools.choice, "calls")
    return "\n".join([f"start: {start}", *lines]) + "\n"


def read_hermes(text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """An answer's ``(content, tool_calls)``: its ``<tool_call>`` blocks in OpenAI's shape (ids made here,
    arguments as JSON text) and the text before them (``None`` when empty); without a block that parses, or
    for a block cut short, the text as it stands."""
    calls = []
    for block in BLOCK.finditer(text):
        try:
            call = jsontext.loads(block.group(1), what="a tool call")
        except ValueError:
            return text, None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and "arguments" in call):
            return text, None
        arguments = json.dumps(call["arguments"], ensure_ascii=False)
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": arguments}})  # fmt: skip
    if not calls or text.count("<tool_call>") != len(calls):
        return text, None
    before = text[: text.index("<tool_call>")].strip()
    return before or None, calls
