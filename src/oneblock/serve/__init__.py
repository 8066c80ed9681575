"""``oneblock serve``: an OpenAI-compatible HTTP server with continuous batching.

* ``engine``: the scheduler thread; requests join the running batch at the next step and leave when done, and
  one request's failure ends that request alone;
* ``memory``: what a cache position costs, whether the cache bound fits the machine, what an allocation failure is;
* ``text``: generated ids to text, with stop strings matched across token boundaries;
* ``protocol``: OpenAI's request fields checked, and its response bodies and stream chunks built;
* ``handlers``: the routes, one named handler each (bodies read with limits, prompts tokenized off the loop,
  server-sent events, hang-ups noticed);
* ``app``: the Starlette application: the routes behind ``oneblock.web``'s guards and the API key;
* ``server``: binding, uvicorn, and a graceful stop on Ctrl-C or SIGTERM.
"""
