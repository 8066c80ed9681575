"""Structured outputs: a grammar (JSON schema, any JSON object, Lark, regex) that decides which tokens may come next.

Shape notation: V vocabulary.

The grammar work is llguidance's (PyPI ``llguidance``, the Rust library behind Guidance, also used by llama.cpp's
``--grammar`` backend and vLLM): it compiles the grammar against the tokenizer's vocabulary and answers, at each
step, the bitmask of the tokens that keep the text inside the grammar (tens of microseconds a token). See
docs/serving.md, "Structured outputs", for why this library rather than xgrammar or outlines-core.

``Constraint`` is the compiled grammar, bound to one tokenizer, checked once, shareable; ``Constraint.start()``
gives each sequence its own ``ConstraintState``, which a ``SamplerState`` applies to that row's logits before
sampling (tokens outside the mask get ``-inf``) and advances with the token chosen. Seeds and batching behave as
without a grammar: each row's mask depends on that row alone.

Tokenizers: any ``tokenizers.Tokenizer`` (a ``tokenizer.json``, a GGUF file's vocabulary through
``GGUFTokenizer``, a ``BPETokenizer``), which llguidance reads as JSON. The byte tokenizer of checkpoints without a
vocabulary is refused: it has no end-of-text id with which a finished answer could end.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from oneblock import jsontext
from oneblock.errors import InputError
from oneblock.inference.grammar_bounds import JSON_DEPTH, check_lark, check_schema, on_large_stack

INSTALL = "pip install llguidance"
# JSON is written as json.dumps writes it: ", " and ": " between items, no other whitespace. llguidance's default
# (any run of whitespace anywhere) lets a small model emit newlines until its token budget ends; a schema's own
# "x-guidance" options still override this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # tokenizer -> LLTokenizer
UNSATISFIABLE = "NoExtensionBias"  # llguidance's error where no byte can extend the text: the grammar has no sentence


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as error:
        raise InputError(f"structured outputs need the llguidance package; install it with: {INSTALL}") from error
    return llguidance


def _backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` inside a oneblock tokenizer (or the object itself), or an InputError."""
    inner = getattr(tokenizer, "tokenizer", tokenizer)
    if not callable(getattr(inner, "to_str", None)):
        raise InputError(
            f"structured outputs need a vocabulary in the tokenizers library's format (a tokenizer.json or a GGUF "
            f"file's); the tokenizer {getattr(tokenizer, 'name', type(tokenizer).__name__)!r} "
            f"({type(tokenizer).__name__}) has none: the byte tokenizer has no end-of-text id to end an answer with"
        )
    return inner


def _cached(tokenizer: Any) -> Any:
    try:
        return _TOKENIZERS.get(tokenizer)
    except TypeError:
        return None


def _shown(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _reason(matcher: Any) -> str:
    """llguidance's error, without the marker its short errors end with."""
    return str(matcher.get_error()).replace("<non-verbose/>", "").strip()


def _loaded(text: str) -> Any:
    """A schema's JSON text as a value, for measuring (``None`` for text that is not JSON: llguidance says why)."""
    try:
        return jsontext.loads(text, what="the JSON schema", max_depth=JSON_DEPTH)
    except InputError:
        return None


def lark_literal(tokenizer: Any, text: str) -> str:
    """``text`` as a Lark grammar (llguidance's dialect) spells it for ``tokenizer``: ``<[id]>`` when the vocabulary
    holds the text whole as one token, else the quoted string. A special token (Mistral's ``[TOOL_CALLS]``) is not
    ordinary text: llguidance lets a quoted string reach it only where nothing else may come next, never beside a
    free-text alternative, so a grammar that means the token names it. Without a tokenizer (``None``), the quoted
    string."""
    backend = getattr(tokenizer, "tokenizer", tokenizer)
    lookup = getattr(backend, "token_to_id", None)
    found = lookup(text) if callable(lookup) else None
    return f"<[{found}]>" if isinstance(found, int) else json.dumps(text)


class Constraint:
    """A grammar compiled for one tokenizer; ``start()`` gives each sequence its own state.

    Build one with ``json_schema``, ``json_object``, ``lark``, ``regex`` or ``from_response_format``.

    Args:
        tokenizer: a oneblock tokenizer holding a ``tokenizers.Tokenizer`` (``GGUFTokenizer``, ``BPETokenizer``),
            or a ``tokenizers.Tokenizer``.
        grammar: a grammar in llguidance's serialized form (what ``llguidance.LLMatcher.grammar_from_*`` return).
        name: what the grammar was made from, for messages.
        eos_ids: the ids that end an answer once the grammar is satisfied (default: the tokenizer's ``eos_id``).

    Raises:
        InputError: a tokenizer without such a vocabulary (the byte tokenizer), no end-of-text id, or a grammar
            llguidance cannot compile (the message names it and quotes llguidance's reason).
    """

    def __init__(self, tokenizer: Any, grammar: str, *, name: str, eos_ids: Sequence[int] | None = None) -> None:
        llg = _llguidance()
        if eos_ids is None:
            eos = getattr(tokenizer, "eos_id", None)
            eos_ids = [eos] if isinstance(eos, int) else []
        self.eos_ids = [int(i) for i in eos_ids]
        if not self.eos_ids:
            raise InputError(
                f"a grammar needs an end-of-text id to end a finished answer; the tokenizer "
                f"{getattr(tokenizer, 'name', type(tokenizer).__name__)!r} has none: pass eos_ids"
            )
        backend = _backend(tokenizer)
        cached = _cached(tokenizer)
        if cached is None or list(cached.eos_tokens) != self.eos_ids:
            cached = llg.LLTokenizer(backend.to_str(), eos_token=self.eos_ids)  # about 0.4 s for 49k tokens
            with contextlib.suppress(TypeError):  # an object that cannot be weakly referenced is not cached
                _TOKENIZERS[tokenizer] = cached
        self.tokenizer = cached
        self.vocab_size = int(cached.vocab_size)
        self.name = name
        # Compiled on a large stack (llguidance recurses per rule and per reference; see grammar_bounds), with
        # short errors (verbose ones quote the parser's state and the whole grammar), and its first step taken
        # once so that a grammar with no sentence, or one past llguidance's own limits, is refused here.
        limits = llg.LLParserLimits(verbose_errors=False)
        self._matcher = on_large_stack(lambda: llg.LLMatcher(cached, grammar, log_level=0, limits=limits))
        if self._matcher.is_error():
            raise InputError(f"the grammar {name} cannot be compiled: {_shown(_reason(self._matcher), 300)}")
        probe = self._matcher.deep_copy()
        on_large_stack(probe.compute_bitmask)
        if probe.is_error():
            if UNSATISFIABLE in probe.get_error():
                raise InputError(
                    f"the grammar {name} is unsatisfiable: no text is a sentence of it (a rule or a schema that "
                    "only refers to itself, with no way out); give it an alternative that ends"
                )
            raise InputError(f"the grammar {name} cannot be used: {_shown(_reason(probe), 300)}")

    @classmethod
    def json_schema(cls, tokenizer: Any, schema: Mapping[str, Any] | str, **options: Any) -> Constraint:
        """Any JSON text valid against ``schema`` (a dict, or its JSON text); llguidance's JSON dialect.

        Raises:
            InputError: a schema that is not a JSON object, or that llguidance cannot compile.
        """
        llg = _llguidance()
        text = schema if isinstance(schema, str) else None
        if text is None:
            if not isinstance(schema, Mapping):
                raise InputError(f"a JSON schema must be an object (a dict); got {type(schema).__name__}")
            try:
                text = json.dumps(schema)
            except (TypeError, ValueError) as error:
                raise InputError(f"the JSON schema is not JSON: {error}") from error
        check_schema(_loaded(schema) if isinstance(schema, str) else schema, text)
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
        except ValueError as error:
            raise InputError(f"the JSON schema {_shown(text)} is not a JSON object: {error}") from error
        return cls(tokenizer, grammar, name=f"JSON schema {_shown(text)}", **options)

    @classmethod
    def json_object(cls, tokenizer: Any, **options: Any) -> Constraint:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls.json_schema(tokenizer, {"type": "object"}, **options)

    @classmethod
    def lark(cls, tokenizer: Any, grammar: str, **options: Any) -> Constraint:
        """Text in the language of a Lark grammar (llguidance's Lark dialect; ``start`` is the start rule).

        Raises:
            InputError: a grammar that is not a string or does not compile.
        """
        if not isinstance(grammar, str):
            raise InputError(f"a Lark grammar must be a string; got {type(grammar).__name__}")
        check_lark(grammar)
        text = _llguidance().LLMatcher.grammar_from_lark(grammar)
        return cls(tokenizer, text, name=f"Lark grammar {_shown(grammar)!r}", **options)

    @classmethod
    def regex(cls, tokenizer: Any, pattern: str, **options: Any) -> Constraint:
        """Text matching ``pattern`` whole (Rust ``regex`` syntax, anchored at both ends).

        Raises:
            InputError: a pattern that is not a string or does not compile.
        """
        if not isinstance(pattern, str):
            raise InputError(f"a regex must be a string; got {type(pattern).__name__}")
        text = _llguidance().LLMatcher.grammar_from_regex(pattern)
        return cls(tokenizer, text, name=f"regex {_shown(pattern)!r}", **options)

    @classmethod
    def from_response_format(cls, tokenizer: Any, response_format: object, **options: Any) -> Constraint | None:
        """OpenAI's ``response_format``: ``{"type": "text"}`` (``None``, no constraint), ``{"type": "json_object"}``
        or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}``.

        Raises:
            InputError: any other shape, naming the field at fault.
        """
        if not isinstance(response_format, Mapping):
            raise InputError(f"response_format must be an object; got {type(response_format).__name__}")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object(tokenizer, **options)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
                raise InputError(
                    f'response_format.json_schema must be an object with a "schema" object; got {_shown(repr(spec))}'
                )
            return cls.json_schema(tokenizer, spec.get("schema", {}), **options)
        raise InputError(
            f"response_format.type must be 'text', 'json_object' or 'json_schema'; got {_shown(repr(kind))}"
        )

    def start(self) -> ConstraintState:
        """A fresh state for one sequence, at the grammar's start."""
        return ConstraintState(self, self._matcher.deep_copy())

    def __repr__(self) -> str:
        return f"Constraint({self.name})"


class ConstraintState:
    """One sequence's place in a grammar: ``allowed`` for the next token, ``consume`` the one chosen.

    Once the grammar is complete and stopped (or an end-of-text id was consumed), only the end-of-text ids are
    allowed, so a row that keeps generating pads with them.
    """

    def __init__(self, constraint: Constraint, matcher: Any) -> None:
        self.constraint, self.matcher = constraint, matcher
        self.ended = False  # an end-of-text id was consumed

    @property
    def finished(self) -> bool:
        """Whether the text so far is complete and nothing but an end-of-text id may follow."""
        return self.ended or (bool(self.matcher.is_stopped()) and not self.matcher.is_error())

    @property
    def accepting(self) -> bool:
        """Whether the text so far is a complete sentence of the grammar (it may still grow)."""
        return self.ended or bool(self.matcher.is_accepting())

    def allowed(self, vocab_size: int) -> Tensor:
        """(V,) bool, True for each token that may come next; ``V = vocab_size`` may exceed the tokenizer's (the
        ids beyond it, a head padded for speed, are never allowed).

        Raises:
            InputError: a ``vocab_size`` below the tokenizer's, or a matcher in an error state.
        """
        n = self.constraint.vocab_size
        if vocab_size < n:
            raise InputError(f"the logits have {vocab_size} entries, fewer than the grammar's vocabulary ({n})")
        if self.finished:
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            mask[self.constraint.eos_ids] = True
            return mask
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)  # (ceil(n / 32) * 4,)
        if self.matcher.is_error():  # a limit of llguidance's reached, or a text with no way on
            raise InputError(f"the grammar {self.constraint.name} failed: {_shown(_reason(self.matcher), 300)}")
        # Token 8 i + j is bit j of byte i; ids past the tokenizer's (a padded head) are never allowed.
        bits = np.unpackbits(words[: (n + 7) // 8], count=vocab_size, bitorder="little")  # (V,) uint8
        bits[n:] = 0  # the last byte's bits past n
        return torch.from_numpy(bits.view(np.bool_))

    def consume(self, token: int) -> None:
        """Advance past ``token``.

        Raises:
            InputError: a token the grammar does not allow here (a caller that skipped the mask).
        """
        if self.ended or (token in self.constraint.eos_ids and self.finished):
            self.ended = True
            return
        if not self.matcher.consume_token(int(token)):
            reason = _shown(_reason(self.matcher), 300)
            raise InputError(f"token {token} is not allowed by the grammar {self.constraint.name} here: {reason}")
        if token in self.constraint.eos_ids:
            self.ended = True
