"""What a grammar may cost before llguidance compiles it, and the thread it is compiled in.

llguidance's compiler recurses once per rule of a chain (``r0: r1 "a"``, ``r1: r2 "a"``, ...) and once per
``$ref`` followed in a JSON schema: about 2 KB of stack a Lark rule and 8 KB a reference, so 6,000 chained rules
or 1,500 nested references overflow a thread's 8 MB stack, and a stack overflow in native code kills the process,
not the call. So a grammar is first measured here (its size in bytes, its rules, its chain of references, the
branches of an ``anyOf``) and refused by name past a bound; then it is compiled in a thread whose stack holds
several times the deepest recursion the bounds allow (``on_large_stack``).
"""

from __future__ import annotations

import re
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from oneblock import jsontext
from oneblock.errors import InputError

MAX_GRAMMAR_BYTES = 512_000
MAX_RULES = 2_000  # Lark rules and terminals; a JSON schema's distinct references count the same
MAX_REF_DEPTH = 256  # references followed one inside the other (real schemas nest a few deep)
MAX_BRANCHES = 1_000  # alternatives of one anyOf / oneOf: llguidance allows 2,000 Earley items in a row
JSON_DEPTH = 4 * MAX_REF_DEPTH  # nesting a schema's JSON may have to be read and measured (deeper: llguidance says)
COMPILE_STACK_BYTES = 64 << 20  # 4 times what MAX_RULES chained rules or references (2 to 8 KB each) need
_STACK_LOCK = threading.Lock()  # threading.stack_size is process-wide: one compile thread is started at a time
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_]\w*(?:\.-?\d+)?[ \t]*:", re.MULTILINE)
_JSON = re.compile(r"%json\s*")
T = TypeVar("T")


def check_lark(grammar: str) -> None:
    """Refuse a Lark grammar past the bounds: its bytes, its rules, and each inline ``%json`` schema's.

    Raises:
        InputError: naming the bound, the value found and the limit.
    """
    _check_bytes(grammar, "Lark grammar")
    rules = len(_RULE.findall(grammar))
    if rules > MAX_RULES:
        raise InputError(f"the Lark grammar has {rules:,} rules; the limit is {MAX_RULES:,}: write fewer rules")
    for found in _JSON.finditer(grammar):
        try:
            schema, _ = jsontext.loads_at(grammar, found.end(), what="a grammar's JSON schema", max_depth=JSON_DEPTH)
        except InputError:
            continue  # llguidance reports the grammar's own errors
        check_schema(schema)


def check_schema(schema: Any, text: str | None = None) -> None:
    """Refuse a JSON schema past the bounds: its bytes (``text``, its JSON, when known), its distinct ``$ref``
    targets, the longest chain of references followed one inside the other, the branches of each ``anyOf``.

    Raises:
        InputError: naming the bound, the value found and the limit.
    """
    if text is not None:
        _check_bytes(text, "JSON schema")
    for node in _nodes(schema, skip_defs=False):
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list) and len(branches) > MAX_BRANCHES:
                raise InputError(
                    f"the JSON schema has an {key} of {len(branches):,} branches; the limit is {MAX_BRANCHES:,}: "
                    "use an enum of values, or fewer branches"
                )
    depth, targets = ref_depth(schema)
    if targets > MAX_RULES:
        raise InputError(
            f"the JSON schema refers to {targets:,} distinct definitions; the limit is {MAX_RULES:,} (max rules)"
        )
    if depth > MAX_REF_DEPTH:
        raise InputError(
            f"the JSON schema nests $ref references {depth:,} deep; the limit is {MAX_REF_DEPTH:,} "
            "(max reference depth): flatten its definitions"
        )


def ref_depth(schema: Any) -> tuple[int, int]:
    """``(depth, targets)``: the longest chain of local ``$ref`` followed one inside the other from the root (a
    reference back into the chain, recursion, counts once), and the number of distinct targets reached."""
    depth: dict[str, int] = {}
    on_path = {"#"}
    frames: list[tuple[str, list[str], list[int]]] = [("#", _refs(schema), [0])]  # (pointer, its refs, [best])
    while frames:
        pointer, refs, best = frames[-1]
        if not refs:
            frames.pop()
            on_path.discard(pointer)
            depth[pointer] = best[0]
            if frames:
                frames[-1][2][0] = max(frames[-1][2][0], 1 + best[0])
            continue
        target = refs.pop()
        if target in depth or target in on_path:
            best[0] = max(best[0], 1 + depth.get(target, 0))
            continue
        found, value = _resolve(schema, target)
        if not found:
            continue
        on_path.add(target)
        frames.append((target, _refs(value), [0]))
    return depth["#"], len(depth) - 1


def on_large_stack(work: Callable[[], T]) -> T:
    """``work()`` run in a thread of its own with a stack of ``COMPILE_STACK_BYTES``; its result or its exception."""
    results: list[T] = []
    failures: list[BaseException] = []

    def run() -> None:
        try:
            results.append(work())
        except BaseException as error:  # handed to the caller's thread
            failures.append(error)

    with _STACK_LOCK:
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="oneblock-grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if failures:
        raise failures[0]
    return results[0]


def _check_bytes(text: str, what: str) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise InputError(f"the {what} is {size:,} bytes; the limit is {MAX_GRAMMAR_BYTES:,} bytes: send a smaller one")


def _nodes(value: Any, *, skip_defs: bool) -> Iterator[dict[str, Any]]:
    """Every object inside ``value`` (iteratively: a schema may nest deeper than Python recurses), leaving out the
    definitions (``$defs``, ``definitions``) where ``skip_defs``."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(v for k, v in item.items() if not (skip_defs and k in ("$defs", "definitions")))
        elif isinstance(item, list):
            stack.extend(item)


def _refs(value: Any) -> list[str]:
    """The distinct local references (``#...``) of a schema, outside its definitions."""
    found = (n.get("$ref") for n in _nodes(value, skip_defs=True))
    return list(dict.fromkeys(r for r in found if isinstance(r, str) and r.startswith("#")))


def _resolve(schema: Any, ref: str) -> tuple[bool, Any]:
    """The value a local reference (``#/a/b``, a JSON pointer in a URI fragment) points at: ``(found, value)``."""
    value = schema
    for part in urllib.parse.unquote(ref[1:]).split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return False, None
    return True, value
