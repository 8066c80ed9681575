"""Pieces every oneblock HTTP server is built from (Starlette on uvicorn), so each server gets the same limits.

* ``guards``: ASGI middleware that answers only requests addressed to this server by a loopback name (or the
  host the user named) and its port, against DNS rebinding, and refuses a POST whose body is not declared JSON
  (415), so a web page cannot send one without a CORS preflight;
* ``body``: the request's JSON body, capped in bytes, nesting depth and integer digits, text checked as Unicode;
* ``gate``: one model computation at a time with at most a few waiting, the waiting done on the event loop
  (no thread held), 503 with ``Retry-After`` beyond, so static files and cheap routes always answer;
* ``transport``: uvicorn's settings: bounded connections, a deadline for a request's headers, quiet hang-ups;
* ``sockets``: the listening socket, its URL, and whether a host is loopback.

The limits and how to raise them are in docs/limits-web.md.
"""
