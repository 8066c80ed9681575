"""What the engine is given (``Job``) and what it gives back (``Event``s), on its thread.

Shape notation: N alternatives reported per token.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from oneblock.inference.batch import Slot
from oneblock.inference.constraints import Constraint
from oneblock.inference.logprobs import TopLogprobs
from oneblock.inference.prefill import Prefill
from oneblock.inference.sampler_state import SamplerState
from oneblock.inference.sampling import Sampling
from oneblock.serve.text import StopText


@dataclass(frozen=True)
class Scored:
    """One token and its log-probability under the raw model distribution (``log_softmax`` of the logits,
    before temperature, penalties, bias or filters); ``None`` for a prompt's first token, which has none.
    ``top`` holds the N most likely ``(id, log-probability)`` pairs, most likely first."""

    id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def rows(cls, ids: list[int], scores: TopLogprobs) -> list[Scored]:
        """One per row of ``scores`` (``chosen`` (n,), ``top_*`` (n, N)), for the tokens ``ids``."""
        chosen, top_ids, top_values = scores.chosen.tolist(), scores.top_ids.tolist(), scores.top_values.tolist()
        return [
            cls(token, lp, tuple(zip(ti, tv, strict=True)))
            for token, lp, ti, tv in zip(ids, chosen, top_ids, top_values, strict=True)
        ]

    @classmethod
    def prompt(cls, ids: list[int], scores: TopLogprobs) -> tuple[Scored, ...]:
        """A prompt's tokens: the first unscored, the others with ``scores`` (rows for tokens 1..T-1)."""
        return (cls(ids[0], None), *cls.rows(ids[1:], scores))


@dataclass(eq=False)
class PromptScores:
    """A prompt's scored tokens (``echo`` with ``logprobs``), shared by its ``n`` choices: the first to start
    computes them, the others read them, so a prompt is scored once per request, not once per choice."""

    tokens: tuple[Scored, ...] | None = None


@dataclass(frozen=True)
class Delta:
    """New text of a request, and the tokens generated since the last ``Delta`` (with their log-probabilities
    when the request asked for them; a token whose text is held back arrives with a later piece)."""

    text: str
    tokens: tuple[Scored, ...] = ()


@dataclass(frozen=True)
class Echoed:
    """A prompt's own tokens with their log-probabilities (``echo`` with ``logprobs``), before any ``Delta``."""

    tokens: tuple[Scored, ...]


@dataclass(frozen=True)
class Done:
    """A request's end: ``finish_reason`` is ``"stop"`` (end-of-turn id or stop string) or ``"length"`` (token
    budget or time limit); the counts are exact (``cached_tokens``: the prompt's positions whose keys and values
    came from the prefix cache)."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt positions read from the prefix cache, not computed


@dataclass(frozen=True)
class Failed:
    """A request that could not be completed: the server is stopping (``status`` 503), it ran out of memory
    (507), or serving it failed (500)."""

    message: str
    status: int = 500


Event = Delta | Echoed | Done | Failed


class QueueFull(Exception):
    """``max_batch`` requests are running and ``max_queue`` are waiting."""


class CacheFull(Exception):
    """The requests running and waiting hold so much of the cache budget that this one's positions do not fit."""

    def __init__(self, needed: int, free: int, budget: int) -> None:
        super().__init__(f"the request needs {needed} cache positions; {free} of {budget} are free")
        self.needed, self.free, self.budget = needed, free, budget


class Stopping(Exception):
    """The engine no longer accepts requests."""


@dataclass(eq=False)
class Job:
    """One sequence as the engine sees it (one choice of a request).

    Attributes:
        prompt: the prompt's ids.
        max_new: the most tokens to generate (>= 1, or 0 with ``echo`` to score the prompt alone; fits beside
            the prompt in the context).
        sampling: its settings; with a seed, its own generator, seeded ``sampling.row_seed(row)``.
        emit: receives the request's events, on the engine's thread; ``Done`` or ``Failed`` comes last.
        stop: stop strings, matched on the text.
        eos_ids: ids that end the reply (not part of the text, not counted).
        seconds: time limit from admission; past it the request ends with ``"length"``.
        row: the choice's index among its prompt's ``n`` (choice ``j`` draws with ``seed + j``).
        top: alternatives per token to report with each token's log-probability; ``None`` reports none.
        echo: start with the prompt's text (an ``Echoed`` event), scored when ``top`` is set.
        scores: where the choices of one prompt share its scores (``None``: this job scores its prompt itself).
        constraint: a grammar the reply must follow; each job gets its own state, applied to its row's logits.
        adapter: the LoRA adapter its row runs with: 0 the base, k the engine's k-th adapter.
        cache_prompt: read the prompt's leading blocks from the prefix cache and keep its own there (``False``:
            computed whole, kept nowhere).
    """

    prompt: list[int]
    max_new: int
    sampling: Sampling
    emit: Callable[[Event], None]
    stop: tuple[str, ...] = ()
    eos_ids: frozenset[int] = frozenset()
    seconds: float = float("inf")
    row: int = 0
    top: int | None = None
    echo: bool = False
    scores: PromptScores | None = None
    constraint: Constraint | None = None
    adapter: int = 0
    cache_prompt: bool = True
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Filled in by the engine:
    slot: Slot | None = None
    reading: Prefill | None = None  # the prompt's read, chunk by chunk, until its first token's logits
    sampler: SamplerState | None = None
    text: StopText = field(init=False)
    pending: list[Scored] = field(default_factory=list)  # tokens whose text has not been handed out yet
    last: int = 0  # the last sampled id, fed at the next step
    produced: int = 0  # completion tokens so far
    deadline: float = 0.0
    held: int = 0  # cache positions reserved for it, given back when it leaves
    queued: float = field(default_factory=time.monotonic)  # when it was made, just before it is submitted
    sampled_at: float | None = None  # when its last token was sampled (its first: the time to first token)

    @property
    def positions(self) -> int:
        """Cache positions the request can fill: the prompt and every new token but the last (never fed back)."""
        return len(self.prompt) + max(self.max_new, 1) - 1

    def cancel(self) -> None:
        """Ask the engine to drop this request at its next step (a client that disconnected)."""
        self.cancelled.set()


class Observer:
    """What the engine tells as it works, on its thread (the server's metrics listen); this one records nothing.

    Each method must be quick and must not raise: it runs between decoding steps.
    """

    def prefilled(self, job: Job) -> None:
        """The job's prompt has been read (prefilled, or scored alone when it asks for no new token)."""

    def sampled(self, job: Job, counted: bool) -> None:
        """The job sampled a token; ``counted`` is False for an end-of-turn id (not part of the reply)."""

    def ended(self, job: Job, event: Event | None) -> None:
        """The job's last event (``Done`` or ``Failed``), or ``None`` for a job whose client went away."""

    def prefix_cache(self, queried: int, hit: int, held_bytes: int) -> None:
        """A prompt looked up in a prefix cache: ``queried`` prompt tokens, ``hit`` of them found already
        computed; the cache now holds ``held_bytes``."""
