"""JSON from elsewhere is parsed by one reader, ``oneblock.jsontext.loads`` (size, depth and digits bounded, every
failure a oneblock error): no other module of the package calls ``json.loads`` or ``json.load``, nor imports them
or a decoder from ``json``, unless it is listed below with the reason its input is not from elsewhere."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "oneblock"
READERS = {"load", "loads", "JSONDecoder", "raw_decode"}
ALLOWED = {
    "jsontext.py": "the bounded reader itself",
    "io/runlock.py": (
        "the lock holder's own record, written by oneblock's RunLock; read at most 4 KiB, and every failure "
        "(RecursionError and ValueError included) is caught and told as 'its pid is not recorded'"
    ),
}


def _json_reads(path: Path) -> list[int]:
    """Line numbers of ``json.load(s)`` calls, ``from json import loads`` and the like in one module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases = {"json"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "json" and a.asname}
    found = []
    for node in ast.walk(tree):
        imported = isinstance(node, ast.ImportFrom) and node.module == "json" and {a.name for a in node.names} & READERS
        called = (
            isinstance(node, ast.Attribute)
            and node.attr in READERS
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
        )
        if imported or called:
            found.append(node.lineno)
    return found


def test_no_module_parses_json_but_the_bounded_reader():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name not in ALLOWED:
            offenders += [f"{name}:{line}" for line in _json_reads(path)]
    assert not offenders, f"parse JSON with oneblock.jsontext.loads instead: {offenders}"


def test_the_scan_finds_what_it_looks_for(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import json\nimport json as j\nfrom json import loads\nx = json.loads('1')\ny = j.load(open('f'))\n"
        "z = json.dumps(1)\n"
    )
    assert _json_reads(sample) == [3, 4, 5]
    assert all((PACKAGE / name).is_file() for name in ALLOWED)  # the allow-list names modules that exist
