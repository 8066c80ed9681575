"""Output helpers shared by the subcommands: rich tables and headings for people, plain JSON for programs."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.rule import Rule
    from rich.table import Table

TICK, CROSS = "✓", "✗"


def console() -> Console:
    """A console on the current ``sys.stdout`` (created per call so that captured output is honoured)."""
    from rich.console import Console

    # Piped output (a file, a pager, a test) gets a generous fixed width rather than rich's 80 columns.
    width = None if sys.stdout.isatty() else 120
    return Console(file=sys.stdout, highlight=False, soft_wrap=False, width=width)


def print_json(data: Any) -> None:
    """``json.dumps`` on stdout, nothing else: no markup, no colour."""
    print(json.dumps(data, indent=2, default=_jsonable))


def report(
    summary: Mapping[str, Any],
    *,
    as_json: bool,
    title: str = "",
    show: Callable[[Mapping[str, Any]], None] | None = None,
) -> None:
    """A command's result: ``summary`` as JSON for programs (``--json``), else ``show(summary)`` for people, or
    by default a two-column table titled ``title`` (byte counts in human units)."""
    if as_json:
        print_json(summary)
    elif show is not None:
        show(summary)
    else:
        rows = [(key, human_bytes(value) if "bytes" in key else value) for key, value in summary.items()]
        console().print(table(title, ["", "value"], rows))


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def table(
    title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]], *, caption: str | None = None
) -> Table:
    """A rich ``Table``; numeric columns (those whose first cell is a number) are right-aligned."""
    from rich.table import Table

    rows = [list(r) for r in rows]
    out = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    for i, name in enumerate(columns):
        numeric = bool(rows) and isinstance(rows[0][i], (int, float)) and not isinstance(rows[0][i], bool)
        out.add_column(name, justify="right" if numeric else "left")
    for row in rows:
        out.add_row(*(cell(v) for v in row))
    return out


def heading(text: str) -> Rule:
    from rich.rule import Rule

    return Rule(f"[bold]{text}[/bold]", align="left")


def cell(value: Any) -> str:
    """How a figure reads in a table: ints with thousands separators, floats to 4 decimals, bools as ticks."""
    from rich.markup import escape

    if isinstance(value, bool):
        return f"[green]{TICK}[/green]" if value else f"[red]{CROSS}[/red]"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return "0" if value == 0.0 else fmt_float(value)
    if value is None:
        return "-"
    if isinstance(value, (list, tuple)):
        return escape(shape(value)) if all(isinstance(v, int) for v in value) else escape(vector(value))
    return escape(str(value))


def fmt_float(x: float, digits: int = 4) -> str:
    if x != 0 and (abs(x) < 10 ** -(digits - 1) or abs(x) >= 1e7):
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}f}"


def shape(dims: Sequence[int]) -> str:
    """``(2, 4, 8)``."""
    return "(" + ", ".join(str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"


def vector(values: Sequence[Any], digits: int = 3) -> str:
    """``[-1.342, -0.447, 0.447, 1.342]``."""
    parts = [f"{v:.{digits}f}" if isinstance(v, float) else str(v) for v in values]
    return "[" + ", ".join(parts) + "]"


def human_bytes(n: int) -> str:
    """``497.8 MB`` (decimal units, as memory figures for models are usually quoted)."""
    size = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")
