"""Chat templates are untrusted code: runtime errors, recursion, endless loops and enormous output are each one
``InputError``; the immutable sandbox still refuses to mutate or escape."""

from __future__ import annotations

import time

import pytest

from oneblock.errors import InputError
from oneblock.inference import chat_template
from oneblock.inference.chat_template import render_chat

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{{ 1/0 }}", "the chat template failed: ZeroDivisionError: division by zero"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deeply"),
        ("{{ 'x' * 10**8 }}", "repeated 100000000 times is too long"),
        ("{{ 2 ** 100000 }}", r"2 \*\* 100000 is too large for a chat template"),
        ("{% for m in messages %}{{ m.content", "rejected the conversation"),
        ("{{ messages.append(1) }}", "rejected the conversation: .*unsafe"),
    ],
)
def test_broken_and_hostile_templates_are_input_errors(template, match):
    with pytest.raises(InputError, match=match):
        render_chat(MESSAGES, template=template)


def test_the_sandbox_still_hides_python_internals():
    try:
        out = render_chat(MESSAGES, template="{{ ''.__class__.__mro__ }}")
    except InputError:
        return
    assert "object" not in out


def test_an_endless_loop_stops_at_the_time_limit(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.3)
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    start = time.perf_counter()
    with pytest.raises(InputError, match=r"ran for more than 0\.3 s"):
        render_chat(MESSAGES, template=loop)
    assert time.perf_counter() - start < 3


def test_enormous_output_stops_at_the_output_limit(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_CHARS", 1000)
    with pytest.raises(InputError, match="wrote more than 1,000 characters"):
        render_chat(MESSAGES, template="{% for i in range(100000) %}{{ i }}{% endfor %}")


def test_a_normal_template_still_renders():
    out = render_chat(MESSAGES, template="{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert out == "<user>Hi"
