"""``oneblock serve``: an OpenAI-compatible HTTP server with continuous batching.

* ``engine``: the scheduler thread; requests join the running batch at the next step and leave when done;
* ``text``: generated ids to text, with stop strings matched across token boundaries;
* ``protocol``: OpenAI's request fields checked, and its response bodies and stream chunks built;
* ``app``: the Starlette application (routes, key, limits, server-sent events);
* ``server``: binding, uvicorn, and a graceful stop on Ctrl-C or SIGTERM.
"""
