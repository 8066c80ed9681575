"""Reading JSON that came from a file or a request: bounded in size and depth, every failure a oneblock error.

``json.loads`` on text from elsewhere fails in ways no caller expects: ``[[[[...]]]]`` nested 50,000 deep raises
``RecursionError``; an integer of 5,000 digits raises a plain ``ValueError`` (Python's limit on converting long
digit strings, which protects against quadratic-time conversion); 100 MB of text builds gigabytes of objects.
``loads`` is the one reader every JSON input of oneblock goes through (checkpoint headers and their metadata,
sealed JSON files, a run's ``config.json``, a Hugging Face ``config.json`` and index, the explorer's request
bodies). It refuses, with the error class the caller names:

- text over ``max_bytes`` (default ``MAX_BYTES``, 100 MB: the largest safetensors header safetensors accepts);
- nesting deeper than ``max_depth`` (default ``MAX_DEPTH``, 64; real configs and headers nest 3 or 4 deep);
- integers of more digits than Python converts (``sys.get_int_max_str_digits()``, 4,300 by default);
- text that is not UTF-8, or not JSON.
"""

from __future__ import annotations

import json
from typing import Any

from oneblock.errors import InputError, OneBlockError

MAX_BYTES = 100_000_000
MAX_DEPTH = 64


def loads(
    data: str | bytes | bytearray | memoryview,
    *,
    what: str,
    error: type[OneBlockError] = InputError,
    max_bytes: int = MAX_BYTES,
    max_depth: int = MAX_DEPTH,
    max_digits: int | None = None,
) -> Any:
    """The JSON value of ``data``, checked against the size and depth limits.

    Args:
        data: the text, or its UTF-8 bytes.
        what: what the text is, for the message (``"the checkpoint header of 'm.safetensors'"``).
        error: the error class to raise.
        max_bytes: the most bytes (or characters, for a ``str``) accepted.
        max_depth: the most levels of nested arrays and objects accepted (``[]`` is depth 1).
        max_digits: the most characters a number may have (``None``: Python's own limit on integers); a request
            body sets it low, since no valid field needs more than an int64's 19 digits.

    Raises:
        ``error``: naming ``what`` and the problem: too large, too deep, an integer too long, not UTF-8, not JSON.
    """
    if len(data) > max_bytes:
        raise error(f"{what} is {len(data):,} bytes of JSON, over the limit of {max_bytes:,}")
    if not isinstance(data, str):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as err:
            raise error(
                f"{what} is not JSON: not UTF-8 text (byte {err.start} is {err.object[err.start]:#04x})"
            ) from None
    hooks: dict[str, Any] = {}
    if max_digits is not None:
        hooks = {"parse_int": _bounded(int, max_digits), "parse_float": _bounded(float, max_digits + 10)}
    try:
        value = json.loads(data, **hooks)
    except RecursionError:
        raise error(f"{what} nests arrays or objects too deeply to read (the limit is {max_depth})") from None
    except json.JSONDecodeError as err:
        raise error(f"{what} is not JSON: {err}") from None
    except ValueError as err:  # Python's limit on the digits of an integer (int_max_str_digits)
        raise error(f"{what} holds a number too long to read: {err}") from None
    depth = nesting_depth(value, stop_after=max_depth)
    if depth > max_depth:
        raise error(f"{what} nests arrays or objects more than {max_depth} deep; the limit is {max_depth}")
    return value


def loads_at(
    text: str, start: int, *, what: str, error: type[OneBlockError] = InputError, max_depth: int = MAX_DEPTH
) -> tuple[Any, int]:
    """The JSON value that begins at ``start`` in ``text`` (a schema written inside a grammar) and the index where
    it ends, bounded in depth as ``loads``.

    Raises:
        ``error``: naming ``what``: too deep, or not JSON there.
    """
    try:
        value, end = json.JSONDecoder().raw_decode(text, start)
    except RecursionError:
        raise error(f"{what} nests arrays or objects too deeply to read (the limit is {max_depth})") from None
    except ValueError as err:
        raise error(f"{what} is not JSON: {err}") from None
    if nesting_depth(value, stop_after=max_depth) > max_depth:
        raise error(f"{what} nests arrays or objects more than {max_depth} deep; the limit is {max_depth}")
    return value, end


def _bounded(kind: type, limit: int) -> Any:
    """A ``json`` number hook that refuses numbers of more than ``limit`` characters before converting them."""

    def parse(text: str) -> Any:
        if len(text) > limit:
            raise InputError(f"a number has {len(text)} digits; the limit is {limit}")
        return kind(text)

    return parse


def nesting_depth(value: Any, *, stop_after: int | None = None) -> int:
    """Levels of nested lists and dicts in ``value`` (a scalar is 0, ``[]`` is 1), walked without recursion.

    Args:
        value: a JSON value.
        stop_after: return as soon as the depth is known to exceed this.
    """
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        if stop_after is not None and deepest > stop_after:
            return deepest
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest
