"""A conversation with a chat model: the history, the context window, and replies streamed as text.

Shape notation: T prompt length, N new tokens.

A chat model sees the whole conversation at every turn, rendered into one prompt by the chat template stored
with its tokenizer (for SmolLM2, ChatML: ``<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n``). The
model only ever continues that text; "memory" is the history re-read from the start, with the key/value cache
making the new tokens cheap within one reply.

The context window bounds prompt + reply: when the rendered prompt plus ``max_new_tokens`` would exceed it, the
oldest exchanges (a user message and the reply to it) are dropped, the system prompt never. Replies end at any of
the tokenizer's ``stop_ids`` (its end-of-text id and the ids its model ends a turn with: Llama 3's ``<|eot_id|>``,
Gemma's ``<end_of_turn>``) or after ``max_new_tokens``.

>>> from oneblock.inference.smollm2 import load_smollm2  # doctest: +SKIP
>>> session = ChatSession(*load_smollm2(), temperature=0)  # doctest: +SKIP
>>> for piece in session.stream("What is the capital of France?"):  # doctest: +SKIP
...     print(piece, end="", flush=True)
The capital of France is Paris.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from oneblock.errors import InputError
from oneblock.inference.generation import generate_stream
from oneblock.inference.sampling import Sampling
from oneblock.models.decoder import Decoder
from oneblock.text.checks import check_text
from oneblock.text.tokenizer import TextStream, Tokenizer, stop_ids_of

Message = dict[str, str]
DEFAULT_NEW_TOKENS = 256


@dataclass(frozen=True)
class Reply:
    """One answer and what it took.

    Attributes:
        text: the reply, decoded from ``ids``.
        ids: the N new token ids, the stop id that ended the turn excluded.
        prompt_tokens: T, the length of the rendered prompt the model read.
        dropped: exchanges dropped from the start of the history to fit this prompt in the context.
        finished: the model ended its turn (``False``: cut at ``max_new_tokens``).
        seconds: wall time from the first forward pass to the last token.
    """

    text: str
    ids: tuple[int, ...]
    prompt_tokens: int
    dropped: int
    finished: bool
    seconds: float


class ChatSession:
    """A multi-turn conversation with a decoder-only chat model.

    Args:
        model: the ``Decoder``.
        tokenizer: its tokenizer (a ``Tokenizer`` with a ``chat_template``).
        system: the system prompt, kept in every prompt; ``None`` leaves the template's default (if any).
        max_new_tokens: the longest reply, in tokens (default: 256, or half the context when that is less).
        sampling: how tokens are chosen (default: greedy, ``Sampling(temperature=0)``); with a seed, reply ``i``
            of the session draws with seed ``seed + i``.
        context: the window in tokens (default and maximum: ``model.config.max_seq_len``).
        compile: compile the per-token step with ``torch.compile`` (see ``generate_stream``).
        cache_dtype: the key/value cache's dtype (default the model's; ``torch.float16`` halves a float32 model's,
            see ``generate``).
        **sampling_options: ``Sampling``'s fields as keywords (``temperature=0.2, top_p=0.9, seed=0``), instead
            of ``sampling``.

    Raises:
        InputError: a model that is not a ``Decoder``, ``max_new_tokens`` outside ``[1, context)``, a context
            above the model's, or sampling settings that select nothing.
    """

    def __init__(
        self,
        model: Decoder,
        tokenizer: Tokenizer,
        *,
        system: str | None = None,
        max_new_tokens: int | None = None,
        sampling: Sampling | None = None,
        context: int | None = None,
        compile: bool = False,
        cache_dtype: torch.dtype | None = None,
        **sampling_options: Any,
    ) -> None:
        if not isinstance(model, Decoder):
            raise InputError(f"a chat needs a decoder-only model (a Decoder); got {type(model).__name__}")
        if sampling is None:
            sampling_options.setdefault("temperature", 0.0)
        sampling = Sampling.of(sampling, **sampling_options)
        limit = model.config.max_seq_len
        context = limit if context is None else context
        if isinstance(context, bool) or not isinstance(context, int) or not 1 < context <= limit:
            raise InputError(f"context must be an int in [2, {limit}] (the model's max_seq_len); got {context!r}")
        if max_new_tokens is None:
            max_new_tokens = min(DEFAULT_NEW_TOKENS, context // 2)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or not 0 < max_new_tokens < context:
            raise InputError(
                f"max_new_tokens must be an int in [1, {context - 1}] so that a prompt fits in the context of "
                f"{context} tokens; got {max_new_tokens!r}"
            )
        if system is not None and not isinstance(system, str):
            raise InputError(f"system must be a str or None; got {type(system).__name__}")
        self.model, self.tokenizer = model, tokenizer
        self.system = system
        self.max_new_tokens, self.context = max_new_tokens, context
        self.sampling = sampling
        self.compile = compile
        self.cache_dtype = cache_dtype
        self.history: list[Message] = []  # user, assistant, user, assistant, ...: the exchanges still in context
        self.replies = 0  # replies given since the session began (seeds the sampler)
        self.last: Reply | None = None

    def messages(self, pending: str | None = None) -> list[Message]:
        """The conversation as the template reads it: the system prompt, the history, then ``pending``."""
        return self._conversation(self.history, pending)

    def _conversation(self, history: list[Message], pending: str | None) -> list[Message]:
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        tail = [{"role": "user", "content": pending}] if pending is not None else []
        return [*head, *history, *tail]

    def reset(self) -> None:
        """Forget the history; the system prompt and the settings stay."""
        self.history.clear()
        self.last = None

    def prompt_ids(self, text: str) -> tuple[list[int], int]:
        """The prompt for the user message ``text``: the rendered ids, and how many old exchanges were dropped.

        The oldest exchanges go first, until the prompt plus ``max_new_tokens`` fits in the context.

        Raises:
            InputError: if ``text`` is not a non-empty str, or does not fit even with the history dropped.
        """
        if not isinstance(text, str) or not text.strip():
            got = repr(text) if isinstance(text, str) else type(text).__name__
            raise InputError(f"a chat message must be a non-empty str; got {got}")
        check_text(text, "the chat message")
        budget = self.context - self.max_new_tokens
        for dropped in range(len(self.history) // 2 + 1):
            ids = self._render(self._conversation(self.history[2 * dropped :], text))
            if len(ids) <= budget:
                return ids, dropped
        raise InputError(
            f"the message renders to a prompt of {len(ids)} tokens (system prompt and template included), more than "
            f"the {budget} the context of {self.context} leaves beside max_new_tokens ({self.max_new_tokens}); "
            "shorten the message or the system prompt, or ask for fewer new tokens"
        )

    def _render(self, messages: list[Message]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return [int(i) for i in ids]

    def stream(self, text: str) -> Iterator[str]:
        """Send the user message ``text``; return an iterator over the reply's text, piece by piece.

        Each piece comes as soon as its tokens are generated, and never ends inside a multi-byte character: a
        token that carries only part of one is held until the rest arrives. The pieces join to ``Reply.text``.
        The exchange joins the history, and ``self.last`` is set, when the iterator is exhausted; a reply
        abandoned half-way (``close()``, Ctrl-C) leaves the session as it was.

        Raises:
            InputError: see ``prompt_ids``; raised here, before any token is generated.
        """
        prompt, dropped = self.prompt_ids(text)
        stops = stop_ids_of(self.tokenizer, self.model.config.eos_token_id)
        sampling = self.sampling
        if sampling.seed is not None:  # a different, repeatable draw for every reply
            sampling = sampling.replace(seed=sampling.seed + self.replies)
        steps = generate_stream(
            self.model,
            prompt,
            self.max_new_tokens,
            sampling=sampling,
            eos_id=list(stops),
            compile=self.compile,
            cache_dtype=self.cache_dtype,
        )
        return self._reply(text, steps, stops, len(prompt), dropped)

    def _reply(
        self, text: str, steps: Generator[Tensor, None, Any], stops: tuple[int, ...], prompt_tokens: int, dropped: int
    ) -> Iterator[str]:
        pieces = TextStream(self.tokenizer)
        new: list[int] = []
        finished = False
        start = time.perf_counter()
        try:
            for step in steps:  # (1,): one new id per step
                token = int(step[0])
                if token in stops:
                    finished = True
                    break
                new.append(token)
                piece = pieces.push([token])
                if piece:
                    yield piece
        finally:
            steps.close()  # restores the model's train/eval mode now, not when collected
        rest = pieces.flush()
        if rest:
            yield rest
        seconds = time.perf_counter() - start
        reply = self.tokenizer.decode(new)
        user = {"role": "user", "content": text}
        self.history = [*self.history[2 * dropped :], user, {"role": "assistant", "content": reply}]
        self.replies += 1
        self.last = Reply(reply, tuple(new), prompt_tokens, dropped, finished, seconds)

    def send(self, text: str) -> str:
        """Send the user message ``text`` and return the whole reply: ``stream``'s pieces, joined."""
        return "".join(self.stream(text))
