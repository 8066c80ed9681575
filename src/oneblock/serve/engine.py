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
from oneblock.errors import OneBlockError
from oneblock.inference.batch import BatchDecoder
from oneblock.inference.logprobs import TopLogprobs, prompt_logprobs, token_logprobs
from oneblock.inference.prefill import CHUNK
from oneblock.inference.prefix_cache import PrefixCache
from oneblock.inference.sampler_state import SamplerState
from oneblock.serve.admission import Admission
from oneblock.serve.admission import positive as _positive
from oneblock.serve.jobs import (
    Delta,
    Done,
    Echoed,
    Event,
    Failed,
    Job,
    Observer,
    Scored,
)
from oneblock.serve.memory import CacheCost, check_fits, is_out_of_memory
from oneblock.serve.text import StopText
from oneblock.text.tokenizer import Tokenizer

PREFIX_BYTES = 512 * 2**20
"""The prefix cache's default budget: 512 MiB (SmolLM2-135M's blocks of about 11,100 positions)."""

log = logging.getLogger("oneblock.serve")


class Engine(Admission):
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
        cache_dtype: the requests' keys and values (default the model's; ``torch.float16`` halves a float32
            model's cache, as llama.cpp's default, rounded as stored).

    Raises:
        InputError: a bound that is not a positive integer, a budget smaller than one request of ``max_context``,
            or a budget whose cache would not fit in this machine's memory.
    """

    def __init__(
        self, model: nn.Module, tokenizer: Tokenizer, *, max_batch: int = 8, max_queue: int = 32,
        max_context: int | None = None, cache_positions: int | None = None, adapters: ServedAdapters | None = None,
        prefix_bytes: int = PREFIX_BYTES, cache_dtype: torch.dtype | None = None,
    ) -> None:  # fmt: skip
        self.prefix = PrefixCache(_positive("prefix_bytes", prefix_bytes, 0), CHUNK)
        self.decoder = BatchDecoder(model, prefix=self.prefix, cache_dtype=cache_dtype)
        self.adapters = adapters
        self.tokenizer = tokenizer
        # A head wider than the vocabulary (padded for speed) must not pick ids the tokenizer cannot decode.
        self.vocab = min(tokenizer.vocab_size, self.decoder.model.config.vocab_size)
        count = len(adapters.names) if adapters is not None else 0
        super().__init__(self.decoder.context, max_batch, max_queue, max_context, cache_positions, count)
        self.cost = CacheCost.of(self.decoder.model, cache_dtype)
        self.position_bytes = self.cost.position_bytes
        # a sliding-window layer holds at most its ring per request, not max_context positions
        self.cache_bytes = self.cost.budget_bytes(self.cache_positions, self.max_batch, self.max_context)
        check_fits(self.cache_positions, self.cache_bytes, self.max_context, prefix_bytes)
        self.steps = 0  # decoding steps run (each serves every active request)
        self.observer = Observer()  # told what happens, on this thread (the server's metrics replace it)
        self.thread = threading.Thread(target=self._loop, name="oneblock-serve-engine", daemon=True)
        self.thread.start()

    def held_bytes(self) -> int:
        """Bytes of key/value cache the running requests' caches hold (a local layer's: at most its ring)."""
        with self.wake:
            return sum(self.cost.request_bytes(j.slot.capacity) for j in self.active if j.slot is not None)

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
        reading = job.reading
        assert reading is not None and job.slot is not None  # set by _start
        if reading.score is not None and not reading.started and _shared(job) is not None:
            reading.score = None  # another choice of the prompt has scored it meanwhile
            job.emit(Echoed(_shared(job) or ()))
        self._use([job])  # each chunk is read with the request's adapter
        logits = reading.advance()
        if logits is None:
            return
        job.reading = None
        if reading.score is not None:
            tokens = Scored.prompt(job.prompt, reading.scores())
            if job.scores is not None:
                job.scores.tokens = tokens
            job.emit(Echoed(tokens))
        self.observer.prefilled(job)
        if job.cache_prompt:
            self.observer.prefix_cache(len(job.prompt), job.slot.cached, self.prefix.bytes)
        if job.max_new == 0:  # the prompt scored, nothing generated
            self._end(job, Done("length", len(job.prompt), 0, job.slot.cached))
            return
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
        """Start reading the request's prompt (``_read`` goes on), scoring it as it goes when asked (``echo`` with
        ``logprobs``: a chunk at a time, between decoding steps, unless one of its choices scored it already)."""
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
        score = job.top if job.echo and _shared(job) is None else None
        if score is not None and len(job.prompt) + max(job.max_new, 1) > self.decoder.context:  # fills the context
            job.emit(Echoed(self._prompt_scores(job)))
            score = None
        elif job.echo and score is None:  # the prompt's text starts the choice; with logprobs, its scores
            job.emit(Echoed(_shared(job) or ()))
        if job.max_new == 0 and score is None:  # the prompt scored, nothing generated
            self.observer.prefilled(job)
            self._end(job, Done("length", len(job.prompt), 0))
            return
        namespace = self.adapters.names[job.adapter - 1] if self.adapters is not None and job.adapter else ""
        job.slot, job.reading = self.decoder.begin(
            job.prompt, max(job.max_new, 1), namespace=namespace, reuse=job.cache_prompt, score=score
        )  # the keys and values of an adapter's prompt are its own: its name is part of their blocks' names
        with self.wake:
            self.reading.append(job)

    def _prompt_scores(self, job: Job) -> tuple[Scored, ...]:
        """The prompt's tokens scored from one forward (a prompt that fills the context: no read can hold it
        beside a new token), shared by the choices of the prompt (``job.scores``)."""
        if _shared(job) is not None or job.top is None:
            return _shared(job) or ()
        tokens = Scored.prompt(job.prompt, prompt_logprobs(self.decoder.model, job.prompt, job.top))
        if job.scores is not None:
            job.scores.tokens = tokens
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


def _shared(job: Job) -> tuple[Scored, ...] | None:
    """The prompt's scores, where another choice of it computed them already."""
    return job.scores.tokens if job.scores is not None else None


def _one_row(scores: TopLogprobs) -> TopLogprobs:
    """A single position's scores as a batch of one: ``chosen`` (1,), ``top_*`` (1, N)."""
    return TopLogprobs(scores.chosen[None], scores.top_ids[None], scores.top_values[None])
