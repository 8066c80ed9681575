"""From a data file to the tokenized examples of a run: length checked, truncated or refused, never empty.

Shape notation: N tokens of one example, T the training window (``--seq-len``): an example of N tokens feeds
N - 1 inputs to the model, so it fits when N - 1 <= T.
"""

from __future__ import annotations

from oneblock.errors import InputError
from oneblock.finetune.records import Dataset
from oneblock.finetune.tokenize import Example, encode_record
from oneblock.text.tokenizer import Tokenizer


def build_examples(dataset: Dataset, tokenizer: Tokenizer, *, seq_len: int, truncate: bool) -> list[Example]:
    """Tokenize every record of ``dataset`` for windows of ``seq_len`` inputs.

    A ``.txt`` file is one token stream cut into windows that overlap by one token, so every token but the first
    is a target exactly once. Examples longer than the window are refused (naming how many and the longest), or
    cut to it with ``truncate``; an example left with no trained token is then dropped.

    Raises:
        InputError: examples longer than ``seq_len`` without ``truncate``; data in which no token is trained.
    """
    if dataset.text is not None:
        ids = tokenizer.encode(dataset.text)
        if len(ids) < 2:
            raise InputError(f"{dataset.path} holds {len(ids)} token(s); training needs at least two")
        windows = [ids[i : i + seq_len + 1] for i in range(0, len(ids) - 1, seq_len)]
        return [
            Example(tuple(w), (False,) + (True,) * (len(w) - 1), f"{dataset.path}@token {i * seq_len}")
            for i, w in enumerate(windows)
        ]
    examples = [encode_record(record, tokenizer, truncate=truncate) for record in dataset.records]
    long = [e for e in examples if len(e.ids) - 1 > seq_len]
    if long and not truncate:
        longest = max(len(e.ids) - 1 for e in long)
        raise InputError(
            f"{len(long)} of {len(examples)} examples are longer than seq_len {seq_len} tokens (the longest, "
            f"{long[0].where if len(long) == 1 else 'e.g. ' + long[0].where}, has {longest}); raise seq_len or "
            "pass truncate=True to cut them"
        )
    if long:
        examples = [Example(e.ids[: seq_len + 1], e.trained[: seq_len + 1], e.where) for e in examples]
    kept = [e for e in examples if e.n_trained > 0]
    if not kept:
        raise InputError(
            f"no token of {dataset.path} is trained: every example's assistant answer lies beyond seq_len "
            f"{seq_len} or is empty; raise seq_len or check the data"
        )
    return kept
