"""The sandbox chat templates run in, with every operation that can build a large string or list bounded.

Jinja's filters build their result in one C call: ``{{ 'a' | center(600000000) }}`` allocates 600 MB before an
output or time limit can look. So each operation that makes something larger than its inputs checks, before it
runs, an upper bound of its result against ``MAX_CHARS`` (characters of a string, items of a list):

* filters: ``center``, ``indent``, ``replace``, ``format``, ``join``, ``wordwrap``, ``tojson(indent=...)``;
* operators: ``*``, ``+``, ``%`` (printf widths), ``**`` (exponents), ``~`` (concatenation);
* ``str.format`` and ``format_map`` (widths in the braces);
* ``range`` is capped by Jinja's sandbox itself (100,000 items).

Every value a template can make is then at most ``MAX_CHARS`` long, so no single step can exhaust memory; the
time limit and the output limit (``chat_template``) bound the number of steps.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable
from typing import Any

MAX_CHARS = 1_000_000
_PRINTF = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACES = re.compile(r"\{([^{}]*)(\{?)")


class TooLarge(Exception):
    """An operation of a template would build a result over ``MAX_CHARS``; raised before it runs."""


def _limit(size: int, what: str) -> None:
    if size > MAX_CHARS:
        raise TooLarge(f"{what} would make {size:,} characters, more than the limit of {MAX_CHARS:,}")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_printf(fmt: str) -> None:
    """Refuse a ``%`` format whose width or precision is ``*`` or over ``MAX_CHARS``."""
    for width, precision in _PRINTF.findall(fmt):
        for n in (width, precision):
            if n == "*" or (n and len(n) > 7) or (n and int(n) > MAX_CHARS):
                raise TooLarge(f"the format {fmt[:40]!r} asks for a width of {n}; the limit is {MAX_CHARS:,}")


def check_brace_format(fmt: str) -> None:
    """Refuse a ``str.format`` string with a width over ``MAX_CHARS`` or a width taken from an argument."""
    for field, nested in _BRACES.findall(fmt):
        spec = field.partition(":")[2]
        numbers = [int(n) if len(n) <= 7 else MAX_CHARS + 1 for n in re.findall(r"\d+", spec)]
        if nested or any(n > MAX_CHARS for n in numbers):
            raise TooLarge(f"the format {fmt[:40]!r} asks for too wide a field; the limit is {MAX_CHARS:,}")


def _text(x: Any) -> str:
    return x if isinstance(x, str) else str(x)


def _center(value: Any, width: Any = 80) -> int:
    return max(len(_text(value)), int(width) if _is_number(width) else 0)


def _indent(s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> int:
    s = _text(s)
    pad = len(width) if isinstance(width, str) else int(width) if _is_number(width) else 0
    return len(s) + (s.count("\n") + 1) * max(pad, 0)


def _replace(s: Any, old: Any, new: Any, count: Any = None) -> int:
    s, old, new = _text(s), _text(old), _text(new)
    n = s.count(old) if old else len(s) + 1
    if _is_number(count) and count >= 0:
        n = min(n, int(count))
    return len(s) + n * max(0, len(new) - len(old))


def _format(value: Any, *args: Any, **kwargs: Any) -> int:
    check_printf(_text(value))
    return len(_text(value)) + sum(len(_text(a)) for a in (*args, *kwargs.values()))


def _join(value: Any, d: Any = "", attribute: Any = None) -> int:
    items = list(value) if isinstance(value, Iterable) else []
    return sum(len(_text(x)) for x in items) + len(_text(d)) * max(len(items) - 1, 0)


def _wordwrap(s: Any, width: Any = 79, break_long_words: bool = True, wrapstring: Any = None, *_: Any) -> int:
    return len(_text(s)) * (1 + len(_text(wrapstring) if wrapstring is not None else "\n"))


_ESTIMATES: dict[str, Callable[..., int]] = {
    "center": _center,
    "indent": _indent,
    "replace": _replace,
    "format": _format,
    "join": _join,
    "wordwrap": _wordwrap,
}


def _bounded_filter(name: str, original: Callable[..., Any], skip: int) -> Callable[..., Any]:
    estimate = _ESTIMATES[name]

    @functools.wraps(original)  # keeps Jinja's pass_eval_context / pass_environment marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        if len(args) > skip and not isinstance(args[skip], (str, list, tuple)) and isinstance(args[skip], Iterable):
            args = (*args[:skip], list(args[skip]), *args[skip + 1 :])  # a generator is read once, here
        _limit(estimate(*args[skip:], **kwargs), f"the filter {name}")
        return original(*args, **kwargs)

    return bounded


def tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """``tojson`` as transformers defines it (no HTML escaping), with its pretty-printed size bounded."""
    compact = json.dumps(x, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
    _limit(len(compact), "tojson")
    if indent:
        width = len(indent) if isinstance(indent, str) else int(indent) if _is_number(indent) else 0
        depth = deepest = items = 0
        for char in re.sub(r'"(?:[^"\\]|\\.)*"', "", compact):  # one line per item, indented by its depth
            if char in "[{":
                depth += 1
                deepest = max(deepest, depth)
            elif char in "]}":
                depth -= 1
            if char in "[{,":
                items += 1
        _limit(len(compact) + (items + 1) * (deepest * max(width, 0) + 1), "tojson with indent")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def bounded_environment() -> Any:
    """Jinja's immutable sandbox, with every size-making operation bounded (see the module docstring)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import _PassArg

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**" and _is_number(left) and _is_number(right) and abs(left) > 1 and abs(right) > 1024:
                raise TooLarge(f"{left!r} ** {right!r} is too large for a chat template")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and _is_number(n) and len(seq) * n > MAX_CHARS:
                        raise TooLarge(f"a sequence of {len(seq)} repeated {n} times is too long")
            if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                _limit(len(left) + len(right), "+")
            if operator == "%" and isinstance(left, str):
                check_printf(left)
            return super().call_binop(context, operator, left, right)

        def wrap_str_format(self, value: Any) -> Any:
            fmt = getattr(value, "__self__", None)
            if isinstance(fmt, str):
                check_brace_format(fmt)
            return super().wrap_str_format(value)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    for name in _ESTIMATES:
        original = env.filters[name]
        skip = 1 if _PassArg.from_obj(original) is not None else 0  # eval_ctx or environment comes first
        env.filters[name] = _bounded_filter(name, original, skip)
    env.filters["tojson"] = tojson
    return env


def bounded_concat(seq: Iterable[Any]) -> str:
    """Jinja's ``~`` (``str_join``), refused past ``MAX_CHARS``."""
    parts = [_text(x) for x in seq]
    _limit(sum(len(p) for p in parts), "~")
    return "".join(parts)
