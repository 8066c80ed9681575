"""``oneblock explore --html``: the explorer page as one self-contained file, its data embedded, its script and
style inlined, nothing fetched: it opens from disk, offline, and shows the same views except live generation."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from oneblock.errors import InputError
from oneblock.explore.analysis import analyze
from oneblock.explore.card import model_card
from oneblock.explore.loading import Explorable
from oneblock.explore.requests import Limits, parse_request
from oneblock.io import files

STATIC = Path(__file__).parent / "static"
STYLE_TAG = '<link rel="stylesheet" href="static/explore.css">'
SCRIPT_TAG = '<script src="static/explore.js"></script>'
# A file page may run only what it carries: inline script and style, no request to anywhere.
FILE_POLICY = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"


def _embeddable(data: Any) -> str:
    """JSON that cannot close its <script> element early: ``</`` and ``<!--`` are escaped (still valid JSON)."""
    return json.dumps(data, separators=(",", ":")).replace("</", "<\\/").replace("<!--", "<\\u0021--")


def render_html(card: dict[str, Any], analysis: dict[str, Any], text: str | None = None) -> str:
    """The page with ``{"card", "analysis", "text"}`` embedded in ``<script type="application/json">``; ``text`` is
    what the user typed (the analysis's own text is decoded from the ids and may show special tokens)."""
    html = (STATIC / "index.html").read_text(encoding="utf-8")
    css = (STATIC / "explore.css").read_text(encoding="utf-8")
    js = (STATIC / "explore.js").read_text(encoding="utf-8")
    if "</script" in js.lower() or "</style" in css.lower():
        raise ValueError("explore.js or explore.css contains a closing tag and cannot be inlined")
    if STYLE_TAG not in html or SCRIPT_TAG not in html:
        raise ValueError("index.html no longer links explore.css and explore.js the way page.py expects")
    policy = f'<meta http-equiv="Content-Security-Policy" content="{FILE_POLICY}">'
    payload = _embeddable({"card": card, "analysis": analysis, "text": text})
    data = f'<script type="application/json" id="explore-data">{payload}</script>'
    html = html.replace('<meta charset="utf-8">', f'<meta charset="utf-8">\n{policy}', 1)
    html = html.replace(STYLE_TAG, f"<style>\n{css}</style>", 1)
    return html.replace(SCRIPT_TAG, f"{data}\n<script>\n{js}</script>", 1)


def write_html(
    explorable: Explorable,
    path: str | os.PathLike[str],
    text: str,
    *,
    target: str | None = None,
    limits: Limits | None = None,
) -> Path:
    """Analyse ``text`` (and the decoder's ``target`` for an encoder-decoder) and write the page to ``path``.

    Raises:
        oneblock.errors.InputError: the text is empty, too long, or does not fit the model (as the server would answer).
    """
    limits = limits or Limits()
    body: dict[str, Any] = {"text": text}
    if target is not None:
        body["target"] = target  # refused by parse_request unless the model is an encoder-decoder
    request = parse_request(body, explorable, limits)
    html = render_html(model_card(explorable, limits), analyze(explorable, request), text)
    out = Path(path)
    files.write_atomic(out, [html.encode("utf-8")], what="page", error=InputError)
    return out
