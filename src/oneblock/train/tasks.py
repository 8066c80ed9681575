"""Synthetic tasks with exact answers: sequence-to-sequence (reverse, sort, copy) for encoder-decoder models and
"which symbol is the majority?" classification for encoder-only models.

Every example comes from a ``torch.Generator``, so a stream is reproducible from its seed and resumable from its
generator state.

Token layout of the sequence-to-sequence tasks (vocabulary ``3 + n_symbols``)::

    PAD = 0, BOS = 1, EOS = 2, symbols 3 .. 3 + n_symbols - 1
    src     = x_1 .. x_L                      (B, L)
    tgt_in  = BOS y_1 .. y_L                  (B, L + 1)   teacher forcing: the target shifted right
    tgt_out = y_1 .. y_L EOS                  (B, L + 1)

Classification (vocabulary ``1 + n_symbols``): ``CLS x_1 .. x_L`` with ``CLS = 0``; the label is the symbol
(0-based) that occurs most often. Sequences whose top count is tied are redrawn, so every label is unambiguous.
"""

from __future__ import annotations

import torch
from torch import Tensor

from oneblock.errors import ConfigError

PAD, BOS, EOS = 0, 1, 2
N_SPECIAL = 3
CLS = 0
SEQ2SEQ_TASKS = ("reverse", "sort", "copy")


def seq2seq_target(task: str, src: Tensor) -> Tensor:
    """The answer to ``task`` for source ids (B, L): reversed, sorted ascending, or copied."""
    if task == "reverse":
        return src.flip(-1)
    if task == "sort":
        return src.sort(dim=-1).values
    if task == "copy":
        return src.clone()
    raise ConfigError(f"unknown sequence task {task!r}; choose one of {', '.join(SEQ2SEQ_TASKS)}")


def seq2seq_batch(task: str, n: int, length: int, n_symbols: int, generator: torch.Generator) -> dict[str, Tensor]:
    """``n`` examples of ``task``: ``src`` (n, L), ``tgt_in`` and ``tgt_out`` (n, L + 1)."""
    src = torch.randint(N_SPECIAL, N_SPECIAL + n_symbols, (n, length), generator=generator)  # (n, L)
    tgt = seq2seq_target(task, src)  # (n, L)
    bos = torch.full((n, 1), BOS, dtype=torch.long)
    eos = torch.full((n, 1), EOS, dtype=torch.long)
    return {
        "src": src,
        "tgt_in": torch.cat([bos, tgt], dim=1),  # (n, L + 1)
        "tgt_out": torch.cat([tgt, eos], dim=1),  # (n, L + 1)
    }


def majority_batch(n: int, length: int, n_symbols: int, generator: torch.Generator) -> dict[str, Tensor]:
    """``n`` classification examples: ``tokens`` (n, 1 + L) starting with CLS, ``labels`` (n,) in 0..n_symbols-1."""
    kept_x: list[Tensor] = []
    kept_y: list[Tensor] = []
    have = 0
    while have < n:
        x = torch.randint(0, n_symbols, (2 * n, length), generator=generator)  # (2n, L) 0-based symbols
        counts = torch.nn.functional.one_hot(x, n_symbols).sum(dim=1)  # (2n, n_symbols)
        top = counts.topk(2, dim=-1).values  # (2n, 2) the two largest counts
        unique = top[:, 0] > top[:, 1]  # (2n,) no tie for first place
        kept_x.append(x[unique])
        kept_y.append(counts[unique].argmax(dim=-1))
        have += int(unique.sum())
    x = torch.cat(kept_x)[:n]
    cls = torch.full((n, 1), CLS, dtype=torch.long)
    return {"tokens": torch.cat([cls, x + 1], dim=1), "labels": torch.cat(kept_y)[:n]}  # (n, 1 + L), (n,)


class SyntheticStream:
    """An endless stream of synthetic batches whose whole state is one generator state.

    Args:
        task: ``reverse``, ``sort``, ``copy`` or ``majority``.
        length: symbols per sequence ``L``.
        n_symbols: alphabet size.
        seed: seeds the generator.
    """

    def __init__(self, task: str, *, length: int, n_symbols: int, seed: int) -> None:
        if task not in (*SEQ2SEQ_TASKS, "majority"):
            raise ConfigError(f"unknown synthetic task {task!r}; choose reverse, sort, copy or majority")
        self.task = task
        self.length = length
        self.n_symbols = n_symbols
        self.generator = torch.Generator().manual_seed(seed)

    def next(self, n: int) -> dict[str, Tensor]:
        """The next ``n`` examples."""
        if self.task == "majority":
            return majority_batch(n, self.length, self.n_symbols, self.generator)
        return seq2seq_batch(self.task, n, self.length, self.n_symbols, self.generator)

    def state_dict(self) -> dict[str, Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.generator.set_state(state["generator"])
