"""A request's prompts as ids: a chat's rendered conversation, or a completion's ``prompt`` in any of OpenAI's
four forms (a string, a list of strings, a list of token ids, a list of such lists)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from oneblock.errors import InputError
from oneblock.serve.checks import bad, shown, text
from oneblock.serve.tool_template import conversation_ids, template_calls, template_format
from oneblock.serve.tools import Tools, call_ids, written_calls, written_result
from oneblock.text.chat_template import render_chat
from oneblock.text.tokenizer import Tokenizer

# The conversation format llama.cpp's server falls back to when a model has no template of its own.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_PROMPTS = 64  # prompts in one completions request


@dataclass(frozen=True)
class Prompt:
    """One prompt: its ids and, for ``echo``, its text (the string as sent, or the ids decoded)."""

    ids: list[int]
    text: str


def chat_prompt(body: Mapping[str, Any], tokenizer: Tokenizer, tools: Tools | None = None) -> Prompt:
    """The conversation rendered with the model's chat template (ChatML without one), ending in the assistant's
    header; with active ``tools``, their description and the answer's format begin the system message, and
    earlier tool calls and results are written in that format (``oneblock.serve.tools``). A template with its own
    tool format (``oneblock.serve.tool_template``) renders the tools and the earlier calls and results itself."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty list of {'role', 'content'} objects")
    names = call_ids(messages)
    own = template_format(getattr(tokenizer, "chat_template", None))  # the template writes tool turns itself
    shown_ids = own.template_ids(conversation_ids(messages)) if own is not None else {}  # as the template sees them
    conversation: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad(f"messages[{i}]", f"message {i} needs a 'role' among {list(ROLES)}; got {shown(message)}")
        role = "system" if message["role"] == "developer" else message["role"]
        turn: dict[str, Any] = {}
        if role == "assistant" and message.get("tool_calls"):
            said = message.get("content")  # text sent beside the calls comes first, on its own line
            said = "" if said is None else text("messages", _content(said, i), f"messages[{i}].content")
            content = (said + "\n" if said else "") + written_calls(message["tool_calls"], i)  # checks the calls
            if own is not None:
                content, turn = said, {"tool_calls": template_calls(message["tool_calls"], shown_ids)}
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad(f"messages[{i}].tool_call_id", f"message {i} (a tool result) needs a 'tool_call_id' string")
            result = text("messages", _content(message.get("content"), i), f"messages[{i}].content")
            if own is not None:
                content, turn = result, {"tool_call_id": shown_ids.get(call_id, call_id), "name": names.get(call_id)}
            else:
                role, content = "user", written_result(result, call_id, names.get(call_id))
        else:
            content = text("messages", _content(message.get("content"), i), f"messages[{i}].content")
        conversation.append({"role": role, "content": content, **turn})
    if own is not None:
        return _rendered(conversation, tokenizer, tools)
    if tools is not None and tools.active:
        if conversation[0]["role"] == "system":
            conversation[0] = {"role": "system", "content": tools.instructions() + "\n\n" + conversation[0]["content"]}
        else:
            conversation.insert(0, {"role": "system", "content": tools.instructions()})
    try:
        if getattr(tokenizer, "chat_template", None):
            ids = [
                int(i) for i in tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
            ]
        else:
            ids = tokenizer.encode(render_chat(conversation, template=CHATML))
    except InputError as error:
        raise bad("messages", str(error)) from None
    return Prompt(ids, "")


def _rendered(conversation: list[dict[str, Any]], tokenizer: Tokenizer, tools: Tools | None) -> Prompt:
    """The conversation rendered by a template with its own tool format, the tools as its ``tools`` variable."""
    listed = None if tools is None or not tools.active else [{"type": "function", "function": dict(f)}
                                                             for f in tools.functions]  # fmt: skip
    try:
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, tools=listed)
    except InputError as error:
        raise bad("messages", str(error)) from None
    return Prompt([int(i) for i in ids], "")


def _content(content: Any, i: int) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts, joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        texts = [p.get("text") for p in content]
        if all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise bad(f"messages[{i}].content", f"message {i}'s content must be a string or a list of text parts")


def text_prompts(body: Mapping[str, Any], tokenizer: Tokenizer, vocab: int) -> list[Prompt]:
    """``prompt`` as a string, a list of strings, a list of token ids or a list of such lists: one ``Prompt``
    each, in order (each gets its own choices).

    Raises:
        ApiError: an empty prompt, a mix of forms, ids outside ``[0, vocab)``, more than ``MAX_PROMPTS``.
    """
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_ids(prompt)):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise bad(
            "prompt", f"'prompt' must be a string, a list of strings, a list of token ids or a list of such lists; "
            f"got {shown(prompt)}",
        )  # fmt: skip
    if len(prompts) > MAX_PROMPTS:
        raise bad("prompt", f"'prompt' holds {len(prompts)} prompts; the limit is {MAX_PROMPTS}")
    return [_one(p, i, len(prompts), tokenizer, vocab) for i, p in enumerate(prompts)]


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def _one(prompt: str | list[int], i: int, count: int, tokenizer: Tokenizer, vocab: int) -> Prompt:
    where = "prompt" if count == 1 else f"prompt[{i}]"
    if not prompt:
        raise bad("prompt", f"'{where}' is empty; a prompt needs at least one token")
    if isinstance(prompt, list):
        outside = [t for t in prompt if not 0 <= t < vocab]
        if outside:
            raise bad("prompt", f"'{where}' holds token id {shown(outside[0])}, outside the vocabulary [0, {vocab})")
        return Prompt(list(prompt), tokenizer.decode(prompt))
    try:
        return Prompt(tokenizer.encode(text("prompt", prompt, where)), prompt)
    except InputError as error:
        raise bad("prompt", str(error)) from None
