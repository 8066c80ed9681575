"""The explorer's web server: a Starlette app with the page, its assets and a small JSON API, run by uvicorn.

API (every answer is JSON; a bad request is a 400 ``{"error": "..."}`` naming the problem, never a traceback):

* ``GET  /api/card``: the model, its config, parameter breakdown, checks and the request caps;
* ``POST /api/analyze``: ``{"text": ...}`` or ``{"ids": [...]}`` (plus ``target`` / ``target_ids`` for an
  encoder-decoder, ``temperature``, ``top_k``) -> tokens, block, attention, logit lens, next token;
* ``POST /api/generate``: the same body plus ``greedy`` and ``seed`` -> the appended token and the new analysis.

One computation runs at a time (a lock), so memory stays that of one forward pass; bodies, texts and token
counts are capped (``Limits``).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from oneblock.errors import InputError, OneBlockError
from oneblock.explore.analysis import analyze, generate_step
from oneblock.explore.card import model_card
from oneblock.explore.loading import Explorable
from oneblock.explore.requests import Limits, parse_request, token_cap
from oneblock.io import jsontext

STATIC = Path(__file__).parent / "static"
BUSY_TIMEOUT_S = 60.0
# The page loads nothing from anywhere else: scripts, styles and requests stay on this server.
PAGE_POLICY = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:"
log = logging.getLogger("oneblock.explore")


class Busy(Exception):
    """Another computation held the lock for longer than ``BUSY_TIMEOUT_S``."""


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers={"Cache-Control": "no-store"})


async def read_json(request: HTTPRequest, limit: int) -> Any:
    """The request's JSON body, refused past ``limit`` bytes before it is all read.

    Raises:
        InputError: too large, not UTF-8 or not JSON.
    """
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise InputError(f"the request body is {declared} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise InputError(f"the request body is over the limit of {limit} bytes")
    return jsontext.loads(body, what="the request body", error=InputError)


def create_app(explorable: Explorable, limits: Limits | None = None) -> Starlette:
    """The explorer for one loaded model; the model card (with its checks) is computed here, once."""
    limits = limits or Limits()
    lock = threading.Lock()
    card = model_card(explorable, limits)
    cap = token_cap(explorable, limits)

    def locked(work: Callable[[], Any]) -> Any:
        if not lock.acquire(timeout=BUSY_TIMEOUT_S):
            raise Busy
        try:
            return work()
        finally:
            lock.release()

    async def compute(request: HTTPRequest, work: Callable[[Any], Any]) -> Response:
        try:
            parsed = parse_request(await read_json(request, limits.max_body), explorable, limits)
            result = await run_in_threadpool(locked, lambda: work(parsed))
        except OneBlockError as error:
            return _error(400, str(error))
        except Busy:
            return _error(503, "the server is busy with another computation; try again")
        except Exception as error:  # a bug, not the user's input: log it here, answer without a traceback
            log.exception("explore: computation failed")
            return _error(500, f"internal error ({type(error).__name__}); the server's log has the details")
        return JSONResponse(result, headers={"Cache-Control": "no-store"})

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
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0 picks a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(64)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def serve(explorable: Explorable, *, host: str = "127.0.0.1", port: int = 8000, limits: Limits | None = None) -> None:
    """Serve the explorer until Ctrl-C; prints the URL first, and a warning when ``host`` is not loopback."""
    import uvicorn

    if not is_loopback(host):
        print(
            f"warning: serving on {host}, reachable from other machines; the explorer has no authentication",
            file=sys.stderr,
        )
    app = create_app(explorable, limits)
    sock = bind(host, port)
    print(f"oneblock explore: {explorable.name} at {url_of(sock)} (Ctrl-C stops)", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    server.run(sockets=[sock])
