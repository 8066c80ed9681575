"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` in the two dialects clients speak.

* llama.cpp's: ``{"content": text}`` -> ``{"tokens": [ids]}``; ``{"tokens": [ids]}`` -> ``{"content": text}``.
* vLLM's, which lm-eval's ``remote`` tokenizer backend uses (so a harness needs no tokenizer of its own):
  ``{"prompt": text, "add_special_tokens": bool}`` -> ``{"tokens", "count", "max_model_len"}``; ``/detokenize``
  answers ``"prompt"`` beside ``"content"``; ``GET /tokenizer_info`` names the special tokens and the template.

The ids are those a completion's ``prompt`` is read as (no chat template).
"""

from __future__ import annotations

from typing import Any

from oneblock.errors import InputError
from oneblock.serve.checks import bad, shown, text
from oneblock.text.tokenizer import Tokenizer

TOKENIZE_FIELDS = {"content": "llama.cpp", "prompt": "vLLM"}


def parse_tokenize(body: Any, tokenizer: Tokenizer, context: int) -> dict[str, Any]:
    """The ids of ``content`` (llama.cpp) or ``prompt`` (vLLM), answered in the dialect asked.

    ``add_special_tokens`` (vLLM's, default true) false leaves out a BOS id the tokenizer would prepend.

    Raises:
        ApiError: 400 for a body without one string ``content`` or ``prompt``, or with any other field.
    """
    given = [name for name in TOKENIZE_FIELDS if isinstance(body, dict) and name in body]
    if len(given) != 1 or not isinstance(body[given[0]], str):
        raise bad("content", f'the body must be {{"content": text}} (or vLLM\'s {{"prompt": text}}); got {shown(body)}')
    field = given[0]
    allowed = {field} | ({"add_special_tokens", "model"} if field == "prompt" else set())
    for name in body:
        if name not in allowed:
            only = sorted(allowed)
            raise bad(name, f"'{name}' is not supported by this server's /tokenize (only {only}); leave it out")
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise bad("add_special_tokens", f"'add_special_tokens' must be true or false; got {shown(special)}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"'model' must be a string; got {shown(model)}")
    try:
        value = text(field, body[field])
        if not special and getattr(tokenizer, "add_bos", False):
            ids: list[int] = tokenizer.encode(value, add_bos=False)  # type: ignore[call-arg]
        else:
            ids = tokenizer.encode(value)
    except InputError as error:
        raise bad(field, str(error)) from None
    if field == "content":
        return {"tokens": ids}
    return {"tokens": ids, "count": len(ids), "max_model_len": context}


def parse_detokenize(body: Any, tokenizer: Tokenizer, vocab: int) -> dict[str, str]:
    """``{"tokens": [ids]}`` to their text, as ``content`` (llama.cpp) and ``prompt`` (vLLM).

    Raises:
        ApiError: 400 for a body without a list of ids in ``[0, vocab)`` or with any other field.
    """
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in tokens):
        raise bad("tokens", f'the body must be {{"tokens": [token ids]}}; got {shown(body)}')
    for name in body:
        if name not in ("tokens", "model"):
            raise bad(name, f"'{name}' is not supported by this server's /detokenize (only 'tokens'); leave it out")
    outside = [i for i in tokens if not 0 <= i < vocab]
    if outside:
        raise bad("tokens", f"'tokens' holds id {shown(outside[0])}, outside the vocabulary [0, {vocab})")
    decoded = tokenizer.decode(tokens)
    return {"content": decoded, "prompt": decoded}


def tokenizer_info(tokenizer: Tokenizer, context: int) -> dict[str, Any]:
    """vLLM's ``GET /tokenizer_info``: the special tokens as strings (``null`` when the tokenizer has none), the
    chat template, the context."""
    specials = getattr(tokenizer, "special_tokens", None)
    names: dict[str, str] = specials() if callable(specials) else {}
    if "eos_token" not in names and tokenizer.eos_id is not None:
        names["eos_token"] = tokenizer.decode([tokenizer.eos_id])
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "bos_token": names.get("bos_token"),
        "eos_token": names.get("eos_token"),
        "pad_token": names.get("pad_token"),
        "chat_template": tokenizer.chat_template,
        "model_max_length": context,
        "vocab_size": tokenizer.vocab_size,
    }
