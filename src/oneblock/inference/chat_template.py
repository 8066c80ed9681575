"""Chat templates: the Jinja programs that turn a conversation into the one string a chat model was trained on.

A template comes from a downloaded file, so it is untrusted code: it runs in Jinja's immutable sandbox.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from oneblock.errors import InputError


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    template: str,
    add_generation_prompt: bool = True,
    **variables: Any,
) -> str:
    """Render a conversation with a Jinja chat template, as ``transformers``' ``apply_chat_template`` does.

    The template runs in Jinja's immutable sandbox (a template from a downloaded file is untrusted code), with
    ``trim_blocks`` and ``lstrip_blocks`` on, the ``loopcontrols`` extension, a ``tojson`` filter that does not
    escape HTML, and the helpers ``raise_exception(msg)`` and ``strftime_now(fmt)``.

    Args:
        messages: ``[{"role": "user", "content": "Hi"}, ...]``.
        template: the Jinja source, e.g. a file's ``tokenizer.chat_template``.
        add_generation_prompt: end with the header of an assistant turn, so the model answers next.
        **variables: further names the template reads, e.g. ``bos_token``, ``eos_token``, ``tools``.

    Raises:
        InputError: if a message is not a mapping with ``role`` and ``content``, or the template raises.
    """
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise InputError(f"message {i} must be a mapping with 'role' and 'content'; got {message!r}")

    def raise_exception(text: str) -> None:
        raise jinja2.exceptions.TemplateError(text)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.exceptions.TemplateError as error:
        raise InputError(f"the chat template rejected the conversation: {error}") from error
