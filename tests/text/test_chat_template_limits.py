"""Chat templates are untrusted code: runtime errors, recursion, endless loops and enormous output are each one
``InputError``; the immutable sandbox still refuses to mutate or escape."""

from __future__ import annotations

import time

import pytest

from oneblock.errors import InputError
from oneblock.text import chat_template
from oneblock.text.chat_template import render_chat

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


def test_the_time_limit_counts_the_threads_cpu_time_not_its_waiting(monkeypatch):
    # A loaded machine that keeps the rendering thread waiting must not make a normal template fail.
    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.05)
    start = time.monotonic()
    out = render_chat(MESSAGES, template="{{ wait() }}ok", wait=lambda: time.sleep(0.3) or "")
    assert out == "ok" and time.monotonic() - start >= 0.3
    with pytest.raises(InputError, match=r"ran for more than 0\.05 s"):
        render_chat(
            MESSAGES, template="{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        )


def test_enormous_output_stops_at_the_output_limit(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_CHARS", 1000)
    with pytest.raises(InputError, match="wrote more than 1,000 characters"):
        render_chat(MESSAGES, template="{% for i in range(100000) %}{{ i }}{% endfor %}")


def test_a_normal_template_still_renders():
    out = render_chat(MESSAGES, template="{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert out == "<user>Hi"


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{{ 'a' | center(600000000) | length }}", "the filter center would make 600,000,000 characters"),
        ("{{ ('ab' * 400000) | replace('a', 'x' * 9) }}", "the filter replace would make"),
        ("{{ ('a' * 900000) | replace('', 'bb') }}", "the filter replace would make"),
        ("{{ '%900000000s' | format('a') }}", "asks for a width of 900000000"),
        ("{{ '%*s' | format(900000000, 'a') }}", r"asks for a width of \*"),
        ("{{ '%900000000d' % 1 }}", "asks for a width of 900000000"),
        ("{{ '{:>900000000}'.format(1) }}", "asks for too wide a field"),
        ("{{ '{:>{w}}'.format(1, w=900000000) }}", "asks for too wide a field"),
        ("{{ ('a\n' * 400000) | indent(100) }}", "the filter indent would make"),
        ("{{ ('a\n' * 400000) | indent('-' * 50) }}", "the filter indent would make"),
        ("{{ range(100000) | join('x' * 100000) }}", "the filter join would make"),
        ("{{ ('a ' * 400000) | wordwrap(1, wrapstring='-' * 10) }}", "the filter wordwrap would make"),
        ("{{ [[[[[[1]]]]]] | tojson(indent=100000000) }}", "tojson with indent would make"),
        ("{{ range(90000) | list | tojson(indent=1000) }}", "tojson with indent would make"),
        ("{% set ns = namespace(s='a' * 900000) %}{% set ns.s = ns.s ~ ns.s %}{{ ns.s | length }}", "~ would make"),
        ("{% set ns = namespace(s='a' * 900000) %}{% set ns.s = ns.s + ns.s %}{{ ns.s | length }}", r"\+ would make"),
        (
            "{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ f('ab', 40) }}",
            "~ would make",
        ),
    ],
)
def test_size_making_operations_are_bounded_before_they_run(template, match):
    with pytest.raises(InputError, match="too large to run: .*" + match):
        render_chat(MESSAGES, template=template)


def test_bounded_filters_still_compute_what_jinja_does():
    template = (
        "{{ 'ab' | center(6) }}|{{ 'a\nb' | indent(2, first=True) }}|{{ 'aXa' | replace('a', 'bc') }}|"
        "{{ '%03d-%s' | format(7, 'x') }}|{{ [1, 2, 3] | join(', ') }}|{{ 'x' ~ 1 ~ 'y' }}|{{ 'ab' + 'c' }}|"
        "{{ '{:>4}'.format('z') }}|{{ '%5.1f' % 2.25 }}|{{ {'a': [1]} | tojson(indent=2) }}|{{ 'a b c' | wordwrap(1) }}"
    )
    out = render_chat(MESSAGES, template=template)
    assert out == '  ab  |  a\n  b|bcXbc|007-x|1, 2, 3|x1y|abc|   z|  2.2|{\n  "a": [\n    1\n  ]\n}|a\nb\nc'
    generated = "{{ messages | map(attribute='role') | join(',') }}|{{ messages | map(attribute='content') | join }}"
    assert render_chat(MESSAGES * 2, template=generated) == "user,user|HiHi"


def test_a_template_over_the_length_cap_is_refused_before_compiling(monkeypatch):
    calls = []
    monkeypatch.setattr(chat_template, "_compile", lambda text: calls.append(text))
    with pytest.raises(InputError, match=r"the chat template is 65,537 characters long; the limit is 65,536"):
        render_chat(MESSAGES, template="x" * 65_537)
    assert calls == []


def test_compilation_is_timed(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_COMPILE_SECONDS", 0.05)
    chat_template._compile.cache_clear()
    template = "{% if messages %}{{ messages[0].content }}{% endif %}" * 1200  # about 60 KB
    with pytest.raises(InputError, match=r"the chat template compiled for more than 0\.05 s"):
        render_chat(MESSAGES, template=template)


def test_a_template_is_compiled_once_per_text():
    chat_template._compile.cache_clear()
    template = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    for turn in range(5):
        assert render_chat([{"role": "user", "content": str(turn)}], template=template) == f"[{turn}]"
    info = chat_template._compile.cache_info()
    assert (info.misses, info.hits) == (1, 4)
