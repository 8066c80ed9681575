"""``GET /metrics``: what the server has done and is doing, in Prometheus' text format (``prometheus_client``).

Names follow vLLM's convention (``vllm:prompt_tokens_total`` ...), with llama-server's where vLLM has none, under
the prefix ``oneblock:``. Every server has a registry of its own, so servers in one process never share a count.

Counted on the engine's thread, per choice (one ``Job``; a request with ``n`` choices of one prompt is n):

* ``oneblock:prompt_tokens_total``: prompt tokens read (prefilled, or scored alone with ``max_tokens: 0``);
* ``oneblock:generation_tokens_total``: generated tokens that make the replies (``usage.completion_tokens``;
  an end-of-turn id is not one);
* ``oneblock:request_success_total{finished_reason}``: choices that ended ``stop`` or ``length``, and ``abort``
  for those whose client went away; ``oneblock:request_failure_total{status}`` those that failed (500, 503, 507);
* ``oneblock:time_to_first_token_seconds``: from the request's arrival at the engine to its first sampled token;
* ``oneblock:time_per_output_token_seconds``: each interval between two tokens of one choice;
* ``oneblock:e2e_request_latency_seconds``: from arrival to the end of a choice that finished;
* ``oneblock:decode_steps_total``: batched decoding steps run (llama-server's ``n_decode_total``);
* ``oneblock:prefix_cache_queries_total``, ``oneblock:prefix_cache_hits_total`` (prompt tokens looked up in the
  prefix cache, and found) and the gauge ``oneblock:prefix_cache_usage_bytes``: 0 until a prefix cache reports.

Read when scraped: ``oneblock:num_requests_running`` (rows in the batch), ``oneblock:num_requests_waiting``
(queued), ``oneblock:kv_cache_usage_bytes`` (key/value cache the running rows hold, each allocated whole),
``oneblock:kv_cache_budget_bytes`` and ``oneblock:kv_cache_usage_perc`` (the fraction of the budget reserved by
the requests running and waiting, 0 to 1, as vLLM's).

Counted at the HTTP edge: ``oneblock:requests_total{endpoint, status}``, every response by route and status,
refusals of the guards included (a stream that fails after its 200 counts 200 here, and its failure above).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from oneblock.serve.engine import Engine
from oneblock.serve.jobs import Done, Event, Failed, Job, Observer

__all__ = ["CountResponses", "Metrics"]
PREFIX = "oneblock:"
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"  # generate_latest's body; every Prometheus reads it
# vLLM's buckets (seconds): a first token from a millisecond (a tiny model) to minutes (a long queue).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)  # fmt: skip


class Metrics(Observer):
    """One server's metrics: its registry, told by its engine (as the engine's ``observer``) and read by
    ``GET /metrics``.

    Args:
        engine: the engine whose work is counted; its ``observer`` becomes this object.
    """

    def __init__(self, engine: Engine) -> None:
        self.registry = registry = CollectorRegistry()
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens read (prefilled), per choice.",
                                     registry=registry)  # fmt: skip
        self.generation_tokens = Counter(
            f"{PREFIX}generation_tokens", "Generated tokens that make the replies (usage.completion_tokens).",
            registry=registry,
        )  # fmt: skip
        self.success = Counter(
            f"{PREFIX}request_success", "Choices that finished, by finish_reason (stop, length; abort: the client "
            "went away).", ["finished_reason"], registry=registry,
        )  # fmt: skip
        self.failure = Counter(f"{PREFIX}request_failure", "Choices that failed, by the status they failed with.",
                               ["status"], registry=registry)  # fmt: skip
        self.ttft = Histogram(
            f"{PREFIX}time_to_first_token_seconds", "Seconds from a request's arrival to its first sampled token.",
            registry=registry, buckets=TTFT_BUCKETS,
        )  # fmt: skip
        self.tpot = Histogram(
            f"{PREFIX}time_per_output_token_seconds", "Seconds between two successive tokens of one choice.",
            registry=registry, buckets=TPOT_BUCKETS,
        )  # fmt: skip
        self.e2e = Histogram(
            f"{PREFIX}e2e_request_latency_seconds", "Seconds from a request's arrival to the end of a choice that "
            "finished.", registry=registry, buckets=E2E_BUCKETS,
        )  # fmt: skip
        self.prefix_queries = Counter(f"{PREFIX}prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      registry=registry)  # fmt: skip
        self.prefix_hits = Counter(f"{PREFIX}prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   registry=registry)  # fmt: skip
        self.prefix_bytes = Gauge(f"{PREFIX}prefix_cache_usage_bytes", "Bytes the prefix cache holds.",
                                  registry=registry)  # fmt: skip
        self.responses = Counter(f"{PREFIX}requests", "HTTP responses, by endpoint and status.",
                                 ["endpoint", "status"], registry=registry)  # fmt: skip
        registry.register(EngineState(engine))
        engine.observer = self

    # -- told by the engine, on its thread -----------------------------------------------------------------------

    def prefilled(self, job: Job) -> None:
        self.prompt_tokens.inc(len(job.prompt))

    def sampled(self, job: Job, counted: bool) -> None:
        now = time.monotonic()
        if job.sampled_at is None:
            self.ttft.observe(now - job.queued)
        else:
            self.tpot.observe(now - job.sampled_at)
        job.sampled_at = now
        if counted:
            self.generation_tokens.inc()

    def ended(self, job: Job, event: Event | None) -> None:
        if event is None:
            self.success.labels("abort").inc()
        elif isinstance(event, Done):
            self.success.labels(event.finish_reason).inc()
            self.e2e.observe(time.monotonic() - job.queued)
        elif isinstance(event, Failed):
            self.failure.labels(str(event.status)).inc()

    def prefix_cache(self, queried: int, hit: int, held_bytes: int) -> None:
        self.prefix_queries.inc(queried)
        self.prefix_hits.inc(hit)
        self.prefix_bytes.set(held_bytes)

    # -- read by the route ---------------------------------------------------------------------------------------

    def text(self) -> bytes:
        """Every metric in Prometheus' text exposition format (version 0.0.4)."""
        return generate_latest(self.registry)

    async def route(self, request: HTTPRequest) -> Response:
        """``GET /metrics``."""
        return Response(self.text(), media_type=TEXT_FORMAT, headers={"Cache-Control": "no-store"})


class EngineState(Collector):
    """The gauges read from the engine when scraped, and its count of decoding steps."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def describe(self) -> Iterable[Metric]:
        return self._families(0, 0, 0, 0, 0)

    def collect(self) -> Iterable[Metric]:
        engine = self.engine
        active, waiting = engine.load()
        _, reserved = engine.cache_use()
        return self._families(active, waiting, engine.held_bytes(), reserved, engine.steps)

    def _families(self, active: int, waiting: int, held_bytes: int, reserved: int, steps: int) -> Iterator[Metric]:
        engine = self.engine
        yield GaugeMetricFamily(f"{PREFIX}num_requests_running", "Requests (choices) in the running batch.", active)
        yield GaugeMetricFamily(f"{PREFIX}num_requests_waiting", "Requests (choices) queued for a row.", waiting)
        yield GaugeMetricFamily(
            f"{PREFIX}kv_cache_usage_bytes", "Bytes of key/value cache the running requests hold.",
            held_bytes,
        )  # fmt: skip
        yield GaugeMetricFamily(
            f"{PREFIX}kv_cache_budget_bytes", "Bytes of key/value cache the requests may reserve together.",
            engine.cache_bytes,
        )  # fmt: skip
        yield GaugeMetricFamily(
            f"{PREFIX}kv_cache_usage_perc", "Fraction (0 to 1) of the cache budget reserved by the requests running "
            "and waiting.", reserved / engine.cache_positions,
        )  # fmt: skip
        yield CounterMetricFamily(f"{PREFIX}decode_steps", "Batched decoding steps run.", steps)


class CountResponses:
    """Count every HTTP response by endpoint (a route's path; ``other`` for a path no route serves) and status.

    Args:
        app: the application inside.
        metrics: whose ``responses`` counter is incremented.
        endpoints: the routes' paths; a path under ``/v1/models/`` counts as ``/v1/models/{id}``.
    """

    def __init__(self, app: ASGIApp, *, metrics: Metrics, endpoints: Iterable[str]) -> None:
        self.app, self.metrics, self.endpoints = app, metrics, frozenset(endpoints)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = "/v1/models/{id}" if path.startswith("/v1/models/") else path
        endpoint = endpoint if endpoint in self.endpoints else "other"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.responses.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)
