"""The explorer's web server: a Starlette app with the page, its assets and a small JSON API, run by uvicorn.

API (every answer is JSON; a bad request is a 400 ``{"error": "..."}`` naming the problem, never a traceback):

* ``GET  /api/card``: the model, its config, parameter breakdown, checks and the request caps;
* ``POST /api/analyze``: ``{"text": ...}`` or ``{"ids": [...]}`` (plus ``target`` / ``target_ids`` for an
  encoder-decoder, ``temperature``, ``top_k``) -> tokens, block, attention, logit lens, next token;
* ``POST /api/generate``: the same body plus ``greedy`` and ``seed`` -> the appended token and the new analysis.

One computation runs at a time and one more may wait (``oneblock.web.gate``; beyond, a 503 with ``Retry-After``),
so memory stays that of one forward pass and the page's files always load; bodies, texts and token counts are
capped (``Limits``). Requests must be addressed to the server by a loopback name (or the host it was bound to)
and its port, and POSTs must be JSON (``oneblock.web.guards``); connections and header time are bounded
(``oneblock.web.transport``).
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from oneblock.errors import OneBlockError
from oneblock.explore.analysis import analyze, generate_step
from oneblock.explore.card import model_card
from oneblock.explore.loading import Explorable
from oneblock.explore.requests import Limits, parse_request, token_cap
from oneblock.web.body import read_json
from oneblock.web.gate import Busy, Gate, Gone
from oneblock.web.guards import HostCheck, HostPolicy, JSONOnly
from oneblock.web.sockets import bind, is_loopback, url_of
from oneblock.web.transport import check_bind_host, server_config

STATIC = Path(__file__).parent / "static"
# The page loads nothing from anywhere else: scripts, styles and requests stay on this server.
PAGE_POLICY = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:"
log = logging.getLogger("oneblock.explore")


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": message}, status_code=status, headers={"Cache-Control": "no-store", **(headers or {})}
    )


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None`` (JSON has no NaN), so an answer always encodes."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def create_app(
    explorable: Explorable, limits: Limits | None = None, *, hosts: HostPolicy | None = None, queue: int = 1
) -> Starlette:
    """The explorer for one loaded model; the model card (with its checks) is computed here, once.

    Args:
        explorable: the model, its tokenizer and names.
        limits: caps on one request.
        hosts: the ``Host`` headers answered (default: loopback names, any port; ``serve`` passes the bound one).
        queue: analyses that may wait while one runs; more get a 503.
    """
    limits = limits or Limits()
    gate = Gate(queue)
    card = model_card(explorable, limits)
    cap = token_cap(explorable, limits)

    async def compute(request: HTTPRequest, work: Callable[[Any], Any]) -> Response:
        try:
            parsed = parse_request(await read_json(request, limits.max_body), explorable, limits)
            result = await gate.run(lambda: _finite(work(parsed)), abandoned=request.is_disconnected)
            return JSONResponse(result, headers={"Cache-Control": "no-store"})
        except OneBlockError as error:
            return _error(400, str(error))
        except Busy as busy:
            message = "the server is busy with another computation; try again"
            return _error(503, message, {"Retry-After": str(busy.retry_after)})
        except (ClientDisconnect, Gone):  # the client hung up: nothing to answer, nothing to log
            return Response(status_code=499)
        except Exception as error:  # a bug, not the user's input: log it here, answer without a traceback
            log.exception("explore: computation failed")
            return _error(500, f"internal error ({type(error).__name__}); the server's log has the details")

    async def page(request: HTTPRequest) -> Response:
        html = (STATIC / "index.html").read_text(encoding="utf-8")
        return HTMLResponse(html, headers={"Content-Security-Policy": PAGE_POLICY, "Cache-Control": "no-store"})

    async def card_route(request: HTTPRequest) -> Response:
        return JSONResponse(card, headers={"Cache-Control": "no-store"})

    async def analyze_route(request: HTTPRequest) -> Response:
        return await compute(request, lambda parsed: analyze(explorable, parsed))

    async def generate_route(request: HTTPRequest) -> Response:
        return await compute(request, lambda parsed: generate_step(explorable, parsed, cap))

    async def http_error(request: HTTPRequest, error: Exception) -> Response:
        status, detail = getattr(error, "status_code", 500), getattr(error, "detail", "error")
        return _error(status, f"{request.method} {request.url.path}: {detail}")

    routes = [
        Route("/", page),
        Route("/api/card", card_route, methods=["GET"]),
        Route("/api/analyze", analyze_route, methods=["POST"]),
        Route("/api/generate", generate_route, methods=["POST"]),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ]
    checks = [Middleware(HostCheck, policy=hosts or HostPolicy()), Middleware(JSONOnly)]  # the host first
    app = Starlette(routes=routes, middleware=checks, exception_handlers={HTTPException: http_error})
    app.state.gate = gate
    return app


def serve(explorable: Explorable, *, host: str = "127.0.0.1", port: int = 8000, limits: Limits | None = None) -> None:
    """Serve the explorer until Ctrl-C; prints the URL first, and a warning when ``host`` is not loopback."""
    import uvicorn

    check_bind_host(host)
    if not is_loopback(host):
        print(
            f"warning: serving on {host}, reachable from other machines; the explorer has no authentication",
            file=sys.stderr,
        )
    sock = bind(host, port)
    app = create_app(explorable, limits, hosts=HostPolicy(host, sock.getsockname()[1]))
    print(f"oneblock explore: {explorable.name} at {url_of(sock)} (Ctrl-C stops)", flush=True)
    server = uvicorn.Server(server_config(app))
    server.run(sockets=[sock])
