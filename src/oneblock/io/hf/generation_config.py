"""The ids a Hugging Face model ends its reply with, from the ``generation_config.json`` of its directory.

A chat model's ``generation_config.json`` lists every id that ends a turn: Llama 3.1 Instruct
``"eos_token_id": [128001, 128008, 128009]`` (``<|end_of_text|>``, ``<|eom_id|>``, ``<|eot_id|>``), Gemma 3
``[1, 106]`` (``<eos>``, ``<end_of_turn>``), Qwen2.5 ``[151645, 151643]``; ``transformers``' ``generate`` stops on
any of them. ``config.json`` often keeps only the base model's one id.
"""

from __future__ import annotations

import os
from pathlib import Path

from oneblock import jsontext
from oneblock.errors import ConversionError

GENERATION_CONFIG = "generation_config.json"


def generation_stop_ids(directory: str | os.PathLike[str], vocab_size: int) -> tuple[int, ...]:
    """The ``eos_token_id`` of ``directory/generation_config.json`` (an int or a list) as a tuple, in its order.

    Empty when the file is absent or has no ``eos_token_id``; ids outside ``[0, vocab_size)`` are left out (a
    config built for another vocabulary, as ``oneblock.io.hf.common.token_id`` treats them).

    Raises:
        ConversionError: a file that is not a JSON object, or an ``eos_token_id`` that is neither an int nor a
            list of ints.
    """
    path = Path(directory) / GENERATION_CONFIG
    if not path.is_file():
        return ()
    what = f"{str(path)!r}"
    try:
        text = path.read_bytes()
    except OSError as error:
        raise ConversionError(f"cannot read {what}: {error.strerror or error}") from None
    data = jsontext.loads(text, what=what, error=ConversionError)
    if not isinstance(data, dict):
        raise ConversionError(f"{what} must hold a JSON object; got a {type(data).__name__}")
    value = data.get("eos_token_id")
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConversionError(f"{what}: eos_token_id must be an int or a list of ints; got {value!r}")
    return tuple(dict.fromkeys(i for i in ids if 0 <= i < vocab_size))
