"""The scheduler: one thread owns the model and runs continuous batching.

Shape notation: B active requests, V vocabulary.

Requests wait in a bounded queue. Between two decoding steps the thread admits waiting requests (up to
``max_batch`` active), reads one chunk of 32 prompt positions of the oldest request still reading its prompt
(each request alone; every chunk of it while no row decodes, so a long prompt delays the decoding rows by one chunk
a step, never by its whole length), then runs one ``BatchDecoder.step`` for every active request and
samples each row with its own ``SamplerState`` (the request's ``logit_bias``, grammar mask, penalties over that
row's tokens, filters, and its own ``torch.Generator``). A request leaves the batch when
it ends (its end-of-turn id, a stop string, its token budget, its time limit), or at the next step after its
client went away. What a request produces reaches its client through ``Job.emit``, called on this thread.

The prefix cache (:mod:`oneblock.inference.prefix_cache`, ``prefix_bytes``) keeps the keys and values of whole
32-position blocks of the prompts read, so a prompt that begins as an earlier one did (a system prompt, the turns
of a conversation so far) copies those blocks and computes only the rest, with the logits it would have without
the cache, bit for bit; ``Done.cached_tokens`` says how many positions it copied.

Because every row is computed independently of the others (see ``oneblock.inference.batch``) and each request
draws from its own generator, a seeded request produces the same tokens alone or in any batch.

With LoRA adapters (``oneblock.adapters.multi.load_adapters``), each job names its row's adapter (0: the base);
before each forward the engine tells the model's ``AdapterRows`` the adapter of every row, so rows of different
adapters share one step: the base products once, each adapter's update on its own rows.

One request's failure is that request's alone: an exception while prefilling it, sampling it or decoding its
text ends it with ``Failed`` (507 for memory, else 500) and the others go on. When a batched step fails, its rows
are run again one at a time, so only the row that fails again is ended (a step that raised advanced no row:
each row's keys are rewritten at the same position). Memory is bounded before anything is allocated: each
request holds at most ``max_context`` positions of cache, and ``submit`` reserves a request's positions against
``cache_positions`` (by default ``max_batch`` requests of ``max_context``), refusing with ``CacheFull`` when
the requests already running and waiting hold them; the engine refuses to start when that bound does not fit
in the machine's memory.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from oneblock.adapters.multi import ServedAdapters
from oneblock.errors import InputError, OneBlockError
from oneblock.inference.batch import BatchDecoder
from oneblock.inference.logprobs import TopLogprobs, prompt_logprobs, token_logprobs
from oneblock.inference.prefill import CHUNK
from oneblock.inference.prefix_cache import PrefixCache
from oneblock.inference.sampler_state import SamplerState
from oneblock.serve.jobs import (
    CacheFull,
    Delta,
    Done,
    Echoed,
    Event,
    Failed,
    Job,
    Observer,
    QueueFull,
    Scored,
    Stopping,
)
from oneblock.serve.memory import check_fits, is_out_of_memory, position_bytes
from oneblock.serve.text import StopText
from oneblock.text.tokenizer import Tokenizer

PREFIX_BYTES = 512 * 2**20
"""The prefix cache's default budget: 512 MiB (SmolLM2-135M's keys and values of about 11,600 positions)."""

log = logging.getLogger("oneblock.serve")


class Engine:
    """Continuous batching over one model, on a thread of its own.

    Args:
        model: a pre-LN decoder-only model (see ``BatchDecoder``), in eval mode.
        tokenizer: decodes the generated ids.
        max_batch: requests decoded together at most.
        max_queue: requests waiting for a row at most; ``submit`` raises ``QueueFull`` beyond.
        max_context: positions one request may fill (prompt plus new tokens); default and upper bound: the
            model's ``max_seq_len``.
        cache_positions: cache positions the requests running and waiting may reserve together (default
            ``max_batch * max_context``); ``submit`` raises ``CacheFull`` beyond.
        adapters: the LoRA adapters ``load_adapters`` put on ``model``; a job's ``adapter`` picks its row's (0:
            the base), and rows of different adapters share each step.
        prefix_bytes: bytes of prompt blocks the prefix cache keeps for later prompts (default ``PREFIX_BYTES``;
            0 keeps none).

    Raises:
        InputError: a bound that is not a positive integer, a budget smaller than one request of ``max_context``,
            or a budget whose cache would not fit in this machine's memory.
    """

    def __init__(
        self, model: nn.Module, tokenizer: Tokenizer, *, max_batch: int = 8, max_queue: int = 32,
        max_context: int | None = None, cache_positions: int | None = None, adapters: ServedAdapters | None = None,
        prefix_bytes: int = PREFIX_BYTES,
    ) -> None:  # fmt: skip
        self.prefix = PrefixCache(_positive("prefix_bytes", prefix_bytes, 0), CHUNK)
        self.decoder = BatchDecoder(model, prefix=self.prefix)
        self.adapters = adapters
        self.tokenizer = tokenizer
        # A head wider than the vocabulary (padded for speed) must not pick ids the tokenizer cannot decode.
        self.vocab = min(tokenizer.vocab_size, self.decoder.model.config.vocab_size)
        self.max_batch, self.max_queue = _positive("max_batch", max_batch), _positive("max_queue", max_queue)
        limit = self.decoder.context
        self.max_context = min(limit, _positive("max_context", limit if max_context is None else max_context, 2))
        budget = self.max_batch * self.max_context if cache_positions is None else cache_positions
        self.cache_positions = _positive("cache_positions", budget, self.max_context)
        self.position_bytes = position_bytes(self.decoder.model)
        check_fits(self.cache_positions, self.position_bytes, self.max_context, prefix_bytes)
        self.reserved = 0  # cache positions held by the requests running and waiting
        self.waiting: collections.deque[Job] = collections.deque()
        self.active: list[Job] = []  # decoding
        self.reading: list[Job] = []  # reading their prompts, the oldest first
        self.accepting = True
        self.cutoff: float | None = None  # when stopping: the moment requests still in flight are ended
        self.running = True  # False ends the thread
        self.steps = 0  # decoding steps run (each serves every active request)
        self.observer = Observer()  # told what happens, on this thread (the server's metrics replace it)
        self.wake = threading.Condition()  # re-entrant: a request may leave while the thread holds it
        self.thread = threading.Thread(target=self._loop, name="oneblock-serve-engine", daemon=True)
        self.thread.start()

    @property
    def context(self) -> int:
        """Positions one request may fill: its prompt plus its new tokens."""
        return self.max_context

    def submit(self, job: Job) -> None:
        """Queue a request and reserve its cache positions; it joins the batch at the next step with a free row.

        Raises:
            Stopping: the engine is shutting down.
            QueueFull: the queue holds ``max_queue`` requests already.
            CacheFull: the requests running and waiting leave too few of ``cache_positions`` for this one.
            InputError: a prompt plus ``max_new`` over ``context`` (the server checks it before).
        """
        self.submit_all([job])

    def submit_all(self, jobs: Sequence[Job]) -> None:
        """``submit`` for the choices of one request: all are queued, or none (the same exceptions)."""
        count = len(self.adapters.names) if self.adapters is not None else 0
        for job in jobs:
            if not 0 <= job.adapter <= count:
                raise InputError(f"adapter {job.adapter} is not one of this engine's (0 to {count})")
            if len(job.prompt) + job.max_new > self.context:
                raise InputError(
                    f"the prompt ({len(job.prompt)} tokens) plus {job.max_new} new tokens is more than the context "
                    f"({self.context})"
                )
        needed = sum(job.positions for job in jobs)
        with self.wake:
            if not self.accepting:
                raise Stopping
            if len(self.waiting) + len(jobs) > self.max_queue:
                raise QueueFull
            if self.reserved + needed > self.cache_positions:
                raise CacheFull(needed, self.cache_positions - self.reserved, self.cache_positions)
            self.reserved += needed
            for job in jobs:
                job.held = job.positions
                self.waiting.append(job)
            self.wake.notify()

    def load(self) -> tuple[int, int]:
        """(active, waiting) requests now; a request reading its prompt is active, one that has ended is not (its
        slot is given back before its last event is sent, while the loop drops it from its lists after)."""
        with self.wake:
            running = sum(j.slot is not None for j in [*self.active, *self.reading])
            return running, len(self.waiting)

    def cache_use(self) -> tuple[int, int]:
        """(positions the running requests' caches hold, positions reserved by those running and waiting)."""
        with self.wake:
            return sum(j.slot.capacity for j in self.active if j.slot is not None), self.reserved

    def refuse(self) -> None:
        """Accept no more requests (``submit`` raises ``Stopping``); the running ones go on."""
        with self.wake:
            self.accepting = False

    def stop(self, grace: float) -> None:
        """Accept no more requests; those running and waiting may finish for ``grace`` seconds, then each ends
        with ``Failed`` (503), so a stream closes with an error event rather than being cut."""
        with self.wake:
            self.accepting = False
            cutoff = time.monotonic() + grace
            self.cutoff = cutoff if self.cutoff is None else min(self.cutoff, cutoff)
            self.wake.notify()

    def close(self, grace: float) -> bool:
        """``stop(grace)``, wait for the requests to end, and stop the thread. Returns whether every request
        finished within ``grace``."""
        self.stop(grace)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(self.load()):
            time.sleep(0.02)
        finished = not any(self.load())
        with self.wake:
            self.running = False
            self.wake.notify()
        self.thread.join(timeout=max(grace, 1.0) + 5.0)
        return finished

    # -- the thread ----------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self.wake:
                while self.running and not self.waiting and not self.active and not self.reading:
                    self.wake.wait()
                if not self.running:
                    break
                if self.cutoff is not None and time.monotonic() >= self.cutoff:
                    self._end_all("the server is shutting down and this request ran past its grace period; retry it")
                    continue
                room = self.max_batch - len(self.active) - len(self.reading)
                admitted = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
            try:
                self._run(admitted)
            except Exception as error:  # a bug of the engine itself, outside any one request: fail them all
                log.exception("serve: the engine failed")
                failed = Failed(f"internal error ({type(error).__name__}); the server's log has details")
                with self.wake:
                    for job in [*admitted, *self.reading, *self.active]:
                        if job.held:  # not ended yet
                            self._end(job, failed)
                    self.active, self.reading = [], []
        with self.wake:
            self._end_all("the server is shutting down; retry the request")

    def _end_all(self, message: str) -> None:
        """End every request running or waiting with a 503 (the caller holds ``wake``)."""
        leftover = [*self.reading, *self.active, *self.waiting]
        self.waiting, self.active, self.reading = collections.deque(), [], []
        for job in leftover:
            self._end(job, Failed(message, status=503))

    def _run(self, admitted: list[Job]) -> None:
        for job in admitted:
            self._guarded(job, self._start)
        self._retire()
        self._read()
        self._retire()
        if self.active:
            self._step(list(self.active))
            self._retire()

    def _read(self) -> None:
        """Prompt chunks between two decoding steps, oldest prompt first: one chunk, then more prompts as long as
        each one's remaining positions fit within a chunk's worth read so far (several short prompts together),
        or every chunk while no row decodes. A prompt read to its end samples its first token and joins the
        decoding rows; no read stalls them for more than about one chunk."""
        budget = CHUNK
        while self.reading:
            job = self.reading[0]
            left = len(job.prompt) - (job.reading.position if job.reading is not None else 0)
            if self.active and budget < CHUNK and left > budget:
                return
            self._guarded(job, self._advance)
            if job.reading is None or job.slot is None:  # read, or ended
                with self.wake:
                    self.reading.remove(job)
                budget -= left
            else:
                budget = 0  # a chunk of a long prompt: enough for this round
            if self.active and budget <= 0:
                return

    def _advance(self, job: Job) -> None:
        assert job.reading is not None and job.slot is not None  # set by _start
        self._use([job])  # each chunk is read with the request's adapter
        logits = job.reading.advance()
        if logits is None:
            return
        job.reading = None
        self.observer.prefilled(job)
        if job.cache_prompt:
            self.observer.prefix_cache(len(job.prompt), job.slot.cached, self.prefix.bytes)
        with self.wake:
            self.active.append(job)
        self._take(job, logits[None])

    def _step(self, jobs: list[Job]) -> None:
        """One token for every active request; a failed batched step is retried row by row."""
        try:
            slots = [j.slot for j in jobs if j.slot is not None]  # every one: _retire dropped the others
            self._use(jobs)
            logits = self.decoder.step(slots, [j.last for j in jobs])  # (B, V)
        except Exception as error:
            if len(jobs) == 1:
                self._fail(jobs[0], error)
                return
            log.warning("serve: a batched step failed (%s); running its rows one at a time", type(error).__name__)
            for job in jobs:
                self._guarded(job, self._step_alone)
            self.steps += 1
            return
        self.steps += 1
        for i, job in enumerate(jobs):
            self._guarded(job, self._take, logits[i : i + 1])

    def _step_alone(self, job: Job) -> None:
        if job.slot is not None:  # ended by an earlier row's failure in some other way: nothing to step
            self._use([job])
            self._take(job, self.decoder.step([job.slot], [job.last]))

    def _use(self, jobs: Sequence[Job]) -> None:
        """Each row of the next forward runs with its job's adapter."""
        if self.adapters is not None:
            self.adapters.rows.select([job.adapter for job in jobs], self.decoder.device)

    def _guarded(self, job: Job, work: Callable[..., None], *args: Any) -> None:
        """``work(job, *args)``; an exception ends this request alone."""
        try:
            work(job, *args)
        except Exception as error:
            self._fail(job, error)

    def _fail(self, job: Job, error: Exception) -> None:
        if is_out_of_memory(error):
            log.warning("serve: a request ran out of memory: %s", error)
            kind = type(error).__name__
            message = f"the server ran out of memory for this request ({kind}); ask for fewer tokens or retry later"
            self._end(job, Failed(message, status=507))
        elif isinstance(error, OneBlockError):  # checked by the server already; a last guard
            self._end(job, Failed(str(error)))
        else:
            log.exception("serve: a request failed", exc_info=error)
            self._end(job, Failed(f"internal error ({type(error).__name__}); the server's log has details"))

    def _start(self, job: Job) -> None:
        """Score the prompt when asked (``echo``) and start reading the request's prompt (``_read`` goes on)."""
        if job.cancelled.is_set():
            self._release(job)
            self.observer.ended(job, None)
            return
        grammar = job.constraint.start() if job.constraint is not None else None
        job.sampler = SamplerState(
            job.sampling, vocab_size=self.vocab, prompt=job.prompt, row=job.row, constraint=grammar
        )  # fmt: skip
        job.text = StopText(self.tokenizer, job.stop)
        job.deadline = time.monotonic() + job.seconds
        self._use([job])  # the prompt is scored and read with the request's adapter
        if job.echo:  # the prompt's text starts the choice; with logprobs, its scores
            job.emit(Echoed(self._prompt_scores(job) if job.top is not None else ()))
        if job.max_new == 0:  # the prompt scored, nothing generated
            self.observer.prefilled(job)
            self._end(job, Done("length", len(job.prompt), 0))
            return
        namespace = self.adapters.names[job.adapter - 1] if self.adapters is not None and job.adapter else ""
        job.slot, job.reading = self.decoder.begin(
            job.prompt, job.max_new, namespace=namespace, reuse=job.cache_prompt
        )  # the keys and values of an adapter's prompt are its own: its name is part of their blocks' names
        with self.wake:
            self.reading.append(job)

    def _prompt_scores(self, job: Job) -> tuple[Scored, ...]:
        """The prompt's tokens scored (the first has none; each other given those before it), from one forward
        shared by the choices of the prompt (``job.scores``)."""
        shared = job.scores
        if shared is not None and shared.tokens is not None:
            return shared.tokens
        assert job.top is not None  # asked by _start only with logprobs
        rows = prompt_logprobs(self.decoder.model, job.prompt, job.top)
        tokens = (Scored(job.prompt[0], None), *Scored.rows(job.prompt[1:], rows))
        if shared is not None:
            shared.tokens = tokens
        return tokens

    def _take(self, job: Job, logits: Tensor) -> None:
        """Sample the request's next token from its (1, V) logits; hand out its text; end it when done."""
        sampler = job.sampler
        assert sampler is not None  # set by _start
        row = logits[:, : self.vocab]  # (1, V)
        token = sampler.choose(row)
        sampler.update(token)
        self.observer.sampled(job, token not in job.eos_ids)
        if token in job.eos_ids:
            self._end(job, self._done(job, "stop"))
            return
        job.produced += 1
        job.last = token
        if job.top is not None:
            scores = token_logprobs(logits[0], torch.tensor(token), job.top)  # the raw distribution
            job.pending.append(Scored.rows([token], _one_row(scores))[0])
        piece = job.text.push(token)
        if piece:
            job.emit(Delta(piece, tuple(job.pending)))
            job.pending = []
        if job.text.stopped:
            self._end(job, self._done(job, "stop"))
        elif job.produced >= job.max_new or time.monotonic() > job.deadline:
            self._end(job, self._done(job, "length"))

    def _done(self, job: Job, reason: str) -> Done:
        rest = job.text.finish()
        if rest or job.pending:
            job.emit(Delta(rest, tuple(job.pending)))
            job.pending = []
        return Done(reason, len(job.prompt), job.produced, job.slot.cached if job.slot is not None else 0)

    def _end(self, job: Job, event: Event) -> None:
        """The request's last event; its cache and its reservation are given back."""
        self._release(job)
        self.observer.ended(job, event)
        try:
            job.emit(event)
        except Exception:  # the client's side is gone in some unexpected way: nothing more to tell it
            log.exception("serve: a request's last event could not be delivered")

    def _release(self, job: Job) -> None:
        job.slot, job.reading = None, None  # frees the cache
        with self.wake:
            self.reserved -= job.held
            job.held = 0

    def _retire(self) -> None:
        """Drop ended and cancelled requests from the batch, giving back their reservations."""
        with self.wake:
            for job in [*self.reading, *self.active]:
                if job.cancelled.is_set() and job.slot is not None:
                    self._release(job)
                    self.observer.ended(job, None)
            self.active = [j for j in self.active if j.slot is not None]
            self.reading = [j for j in self.reading if j.slot is not None]


def _one_row(scores: TopLogprobs) -> TopLogprobs:
    """A single position's scores as a batch of one: ``chosen`` (1,), ``top_*`` (1, N)."""
    return TopLogprobs(scores.chosen[None], scores.top_ids[None], scores.top_values[None])


def _positive(name: str, value: Any, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InputError(f"{name} must be an integer >= {least}; got {value!r}")
    return value
