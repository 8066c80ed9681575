"""Which request fields the server honours, which it refuses and why, and the sampling fields read into a
``Sampling``.

A field is honoured (it changes the answer as OpenAI documents), accepted because its value asks for nothing
(``user``, ``best_of`` equal to ``n``, ``suffix: ""``, ``response_format: {"type": "text"}``), or refused with a
400 that names it: never silently ignored.
docs/serving.md has the whole table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from oneblock.inference.sampling import BIAS_RANGE, MAX_ID, PENALTY_RANGE, Sampling
from oneblock.serve.checks import bad, integer, number, shown

MAX_BIAS = 1024  # logit_bias entries per request
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs (vLLM's on a legacy logprobs: N)
MAX_REPETITION = 10.0  # repetition_penalty's upper bound (1 changes nothing)

# Fields honoured on both endpoints (OpenAI's, then the extensions vLLM and llama.cpp accept).
COMMON = frozenset({
    "model", "stream", "stream_options", "stop", "temperature", "top_p", "n", "max_tokens", "max_completion_tokens",
    "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user", "response_format",
    "top_k", "min_p", "repetition_penalty", "cache_prompt",
})  # fmt: skip
KNOWN = {
    "chat": COMMON | {"messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"},
    "text": COMMON | {"prompt", "echo", "best_of", "suffix", "grammar"},
}
# Fields other servers know, refused here with the reason (anything else gets the generic message).
REFUSED = {
    "functions": "the deprecated function calling is not implemented; send 'tools'",
    "function_call": "the deprecated function calling is not implemented; send 'tool_choice'",
    "grammar": "a Lark grammar is read on /v1/completions only; on a chat send OpenAI's 'response_format' with "
    "a JSON schema",
    "json_schema": "llama.cpp's json_schema field is not read; send OpenAI's 'response_format': {'type': "
    "'json_schema', 'json_schema': {'schema': ...}}",
    "n_probs": "llama.cpp's n_probs is not read; send OpenAI's 'logprobs' (and 'top_logprobs' on a chat)",
    "min_tokens": "a minimum reply length is not implemented",
    "repeat_penalty": "llama.cpp's repeat_penalty (over its last 64 tokens) is not read; send 'repetition_penalty' "
    "(over the prompt and the whole reply)",
    "repeat_last_n": "penalties cover the whole prompt and reply; there is no window",
    "n_predict": "llama.cpp's n_predict is not read; send 'max_tokens'",
    "typical_p": "typical sampling is not implemented",
    "mirostat": "mirostat sampling is not implemented",
    "store": "this server stores no completions",
    "metadata": "this server stores no completions",
    "stream_options.continuous_usage_stats": "usage comes once, in the last chunk",
}


def check_known(body: Mapping[str, Any], kind: Literal["chat", "text"]) -> None:
    """Refuse any field this endpoint does not read, naming it.

    Raises:
        ApiError: 400, ``param`` the first such field (in the body's order).
    """
    for name in body:
        if name in KNOWN[kind]:
            continue
        reason = REFUSED.get(name)
        if reason is None:
            other = "chat completions" if kind == "text" else "completions"
            where = f" (it belongs to {other})" if name in KNOWN["chat" if kind == "text" else "text"] else ""
            reason = f"it is not a field this endpoint reads{where}"
        raise bad(name, f"'{name}' is not supported by this server: {reason}; leave it out")


def sampling(body: Mapping[str, Any], vocab: int) -> Sampling:
    """The request's ``Sampling``: every field checked by name before the library sees it.

    Args:
        body: the request.
        vocab: ids the engine samples from (``logit_bias`` keys must lie below it).

    Raises:
        ApiError: 400 naming the field, its range and the value.
    """
    top_p = number(body, "top_p", 1.0, 0.0, 1.0)  # 0 keeps only the most likely token: greedy, as llama-server
    top_k = integer(body, "top_k", -1, MAX_ID, " (0 or -1: every token)")
    min_p = number(body, "min_p", 0.0, 0.0, 1.0)
    repetition = number(body, "repetition_penalty", 1.0, 0.0, MAX_REPETITION)
    if repetition == 0:
        raise bad(
            "repetition_penalty", f"'repetition_penalty' must be in (0, {MAX_REPETITION:g}] (1 changes nothing); got 0"
        )
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**63):
        raise bad("seed", f"'seed' must be an integer in [-2**63, 2**63) or null; got {shown(seed)}")
    return Sampling(
        temperature=number(body, "temperature", 1.0, 0.0, 2.0),
        top_k=top_k if top_k is not None and top_k > 0 else None,
        top_p=None if top_p in (0, 1) else top_p,
        min_p=min_p or None,
        presence_penalty=number(body, "presence_penalty", 0.0, -PENALTY_RANGE, PENALTY_RANGE),
        frequency_penalty=number(body, "frequency_penalty", 0.0, -PENALTY_RANGE, PENALTY_RANGE),
        repetition_penalty=repetition,
        logit_bias=logit_bias(body.get("logit_bias"), vocab),
        seed=seed,
        greedy=top_p == 0,
    )


def logit_bias(value: Any, vocab: int) -> dict[int, float]:
    """OpenAI's ``logit_bias``: ``{"token id": bias}``, ids as decimal strings below ``vocab``, biases in
    [-100, 100] added to the logits (-100 bans a token)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad("logit_bias", f"'logit_bias' must be an object mapping token ids to biases; got {shown(value)}")
    if len(value) > MAX_BIAS:
        raise bad("logit_bias", f"'logit_bias' names {len(value)} tokens; the limit is {MAX_BIAS}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < vocab):
            raise bad(
                "logit_bias",
                f"'logit_bias' keys must be token ids in [0, {vocab}) written as strings; got {shown(key)}",
            )
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -BIAS_RANGE <= bias <= BIAS_RANGE:
            raise bad(
                "logit_bias",
                f"'logit_bias[{key}]' must be a number in [-100, 100] (-100 bans the token); got {shown(bias)}",
            )
        out[int(key)] = float(bias)
    return out


def top_logprobs(body: Mapping[str, Any], kind: Literal["chat", "text"]) -> int | None:
    """Alternatives per token to report (``None``: no log-probabilities): a chat's ``logprobs: true`` with
    ``top_logprobs: N``, or a completion's legacy ``logprobs: N``."""
    if kind == "text":
        return integer(body, "logprobs", 0, MAX_TOP_LOGPROBS, " (alternatives per token) or null")
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise bad("logprobs", f"'logprobs' must be true or false on a chat completion; got {shown(wanted)}")
    top = integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return (top or 0) if wanted else None
