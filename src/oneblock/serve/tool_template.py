"""Tool calling in the chat template's own format, when the template has one this server knows.

A template has a tool format when it reads the ``tools`` variable (Hugging Face's convention,
``apply_chat_template(messages, tools=[...])``) and writes calls in one of these formats, told apart by the markers
llama.cpp's ``common/chat.cpp`` looks for, in this order:

- ``hermes`` (``tool_hermes``): ``<tool_call>`` blocks (Hermes, Qwen 2.5 and 3);
- ``mistral`` (``tool_mistral``): ``[TOOL_CALLS]`` and a JSON list (Mistral Nemo, Small written like it);
- ``llama3`` (``tool_llama3``): one JSON object, results under an ``ipython`` header (Llama 3.1 to 3.3).

Such a conversation is rendered by the template itself: the tools as its ``tools`` variable (OpenAI's list is
already Hugging Face's shape), an assistant message's ``tool_calls`` with their arguments as objects, a ``tool``
message with its ``tool_call_id`` and the called function's ``name``, each id as the format shows it
(``TemplateFormat.template_ids``). The answer is constrained by the format's Lark grammar to text or calls, each
valid against its function's schema (``Tools.call_schemas``), and read back by the format's reader. Any other
template, one that reads ``tools`` with a call format this server cannot read included, is served in the generic
format (``oneblock.serve.tools``).
"""

from __future__ import annotations

from typing import Any

from oneblock import jsontext
from oneblock.serve.template_format import READS_TOOLS, Answer, TemplateFormat
from oneblock.serve.tool_hermes import HERMES, HERMES_FORMAT
from oneblock.serve.tool_llama3 import LLAMA3, LLAMA3_FORMAT
from oneblock.serve.tool_mistral import MISTRAL, MISTRAL_FORMAT
from oneblock.serve.tools import Tools

__all__ = [
    "FORMATS", "GENERIC", "HERMES", "LLAMA3", "MISTRAL", "conversation_ids", "read_template_answer", "template_calls",
    "template_format", "template_grammar", "tool_format",
]  # fmt: skip
GENERIC = "generic"
FORMATS = (HERMES_FORMAT, MISTRAL_FORMAT, LLAMA3_FORMAT)  # checked in this order
_BY_NAME = {f.name: f for f in FORMATS}


def template_format(template: str | None) -> TemplateFormat | None:
    """The tool format of a chat template's source, or ``None`` (the generic format)."""
    if not template or not READS_TOOLS.search(template):
        return None
    return next((f for f in FORMATS if f.detect(template)), None)


def tool_format(template: str | None) -> str:
    """The name of a chat template's tool format: ``"hermes"``, ``"mistral"``, ``"llama3"`` or ``"generic"``."""
    found = template_format(template)
    return GENERIC if found is None else found.name


def template_grammar(tools: Tools, tokenizer: Any) -> str:
    """The Lark grammar of an answer in ``tools.format`` (a template's own), for ``tokenizer``."""
    return _BY_NAME[tools.format].grammar(tools, tokenizer)


def read_template_answer(text: str, tools: Tools) -> Answer:
    """An answer's ``(content, tool_calls)`` read in the template format ``tools.format``."""
    return _BY_NAME[tools.format].read(text, tools)


def conversation_ids(messages: list[Any]) -> list[str]:
    """The call ids of a conversation in order of appearance: its calls' ``id`` and its results'
    ``tool_call_id``."""
    ids = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        for call in calls if isinstance(calls, list) else []:
            if isinstance(call, dict) and isinstance(call.get("id"), str):
                ids.append(call["id"])
        if message.get("role") == "tool" and isinstance(message.get("tool_call_id"), str):
            ids.append(message["tool_call_id"])
    return list(dict.fromkeys(ids))


def template_calls(calls: list[Any], ids: dict[str, str]) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` (checked OpenAI shape) as templates read them: arguments as objects
    (JSON text that does not parse stays text), each id as ``ids`` shows it."""
    out = []
    for call in calls:
        function = call["function"]
        try:
            arguments: Any = jsontext.loads(function["arguments"], what="a tool call's arguments")
        except ValueError:
            arguments = function["arguments"]
        call_id = call.get("id")
        out.append({"id": ids.get(call_id, call_id) if isinstance(call_id, str) else call_id, "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})  # fmt: skip
    return out
