"""Byte-level text data: any UTF-8 file becomes a stream of token ids 0..255, split into a training part and a
held-out part, and served as random windows whose position in the epoch can be saved and restored.

Bytes need no tokenizer and no download: the vocabulary is the 256 byte values, every file is representable,
and a multi-byte character simply spans several tokens.
"""

from __future__ import annotations

import hashlib
import os
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from oneblock.errors import CheckpointError, InputError
from oneblock.io import limits

BYTE_VOCAB = 256
DEFAULT_CORPUS = "corpus.txt"


def default_corpus() -> bytes:
    """The small original corpus shipped in ``oneblock/data`` (used when no ``--text`` is given)."""
    return (resources.files("oneblock") / "data" / DEFAULT_CORPUS).read_bytes()


def read_text(path: str | Path | None, *, max_bytes: int | None = None) -> bytes:
    """Bytes of a UTF-8 text file, or of the default corpus when ``path`` is None.

    A pipe or a device (``<(cmd)``, ``/dev/stdin``) is read like a file, but never past the limit: ``/dev/zero``
    never ends, and each byte becomes an 8-byte token id.

    Args:
        path: the file; None for the default corpus.
        max_bytes: the most bytes read (``oneblock.io.limits.text_limit``: ``ONEBLOCK_MAX_TEXT_BYTES``, else
            256 MiB).

    Raises:
        InputError: the file is missing, empty, over the limit or not UTF-8.
    """
    if path is None:
        return default_corpus()
    path = Path(path)
    if not path.exists():
        raise InputError(f"text file {str(path)!r} does not exist; give an existing UTF-8 file")
    if path.is_dir():
        raise InputError(f"text file {str(path)!r} is a directory; give a UTF-8 file")
    limit, source = limits.text_limit(max_bytes)
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size  # a device or a pipe (/dev/null, <(cmd)) reports 0 and is read
            data = b"" if size > limit else f.read(limit + 1)
    except OSError as error:
        raise InputError(f"cannot read the text file {str(path)!r}: {error.strerror or error}") from None
    if size > limit or len(data) > limit:
        told = f"is {size:,} bytes, over" if size > limit else "goes on past"
        raise InputError(
            f"text file {str(path)!r} {told} the limit of {limit:,} bytes ({source}); train on a part of it, "
            f"or raise the limit with {limits.ENV_MAX_TEXT_BYTES}"
        )
    if not data:
        raise InputError(f"text file {str(path)!r} is empty; give it some text to learn from")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError(
            f"text file {str(path)!r} is not UTF-8 (byte {error.start} is {data[error.start]:#04x}); "
            "convert it with iconv or pick another file"
        ) from None
    return data


def fingerprint(path: str | Path | None, raw: bytes) -> dict[str, Any]:
    """What identifies a text: its path (None for the shipped corpus), its length in bytes and its SHA-256."""
    return {"text": None if path is None else str(path), "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}


def encode(text: str | bytes) -> Tensor:
    """Text to byte ids (N,) long."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def decode(ids: Tensor | list[int]) -> str:
    """Byte ids to text; ids outside 0..255 are dropped and broken UTF-8 sequences become U+FFFD."""
    values = ids.tolist() if isinstance(ids, Tensor) else list(ids)
    return bytes(v for v in values if 0 <= v < BYTE_VOCAB).decode("utf-8", errors="replace")


def split(ids: Tensor, val_fraction: float, window: int) -> tuple[Tensor, Tensor]:
    """Split ids (N,) into a training head and a held-out tail of ``val_fraction`` of the bytes.

    Both parts must hold at least one window of ``window`` ids (inputs plus the shifted target).

    Raises:
        InputError: the text is too short for the window.
    """
    n_val = max(window, round(len(ids) * val_fraction))
    n_train = len(ids) - n_val
    if n_train < window:
        raise InputError(
            f"text of {len(ids)} bytes is too short for windows of {window} bytes with a held-out split of "
            f"{n_val}; use a longer text or a smaller seq_len"
        )
    return ids[:n_train], ids[n_train:]


class TextWindows:
    """Random windows of ``window`` ids from a 1-D id tensor, epoch by epoch.

    Each epoch lays non-overlapping windows at a random shift and visits them in a random order; both come from
    ``(seed, epoch)`` alone, so the position ``(epoch, cursor)`` is the complete state of the stream.

    Args:
        ids: (N,) token ids.
        window: ids per window (``seq_len + 1`` for next-token prediction).
        seed: fixes every epoch's shift and order.
    """

    def __init__(self, ids: Tensor, window: int, *, seed: int) -> None:
        if len(ids) < window:
            raise InputError(f"need at least {window} ids for one window; got {len(ids)}")
        self.ids = ids
        self.window = window
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self._starts = self._epoch_starts(0)

    def _epoch_starts(self, epoch: int) -> Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        slack = len(self.ids) - self.window
        shift = int(torch.randint(0, min(self.window, slack) + 1, (1,), generator=gen))
        starts = torch.arange(shift, slack + 1, self.window)  # (W,) non-overlapping windows
        return starts[torch.randperm(len(starts), generator=gen)]

    def next(self, n: int) -> Tensor:
        """The next ``n`` windows, (n, window) long; crosses into the next epoch when this one runs out."""
        rows: list[Tensor] = []
        while len(rows) < n:
            if self.cursor == len(self._starts):
                self.epoch += 1
                self.cursor = 0
                self._starts = self._epoch_starts(self.epoch)
            start = int(self._starts[self.cursor])
            rows.append(self.ids[start : start + self.window])
            self.cursor += 1
        return torch.stack(rows)  # (n, window)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at a saved position.

        Raises:
            CheckpointError: the position lies outside this text's epoch (the text is not the one saved with it).
        """
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        starts = self._epoch_starts(epoch) if epoch >= 0 else None
        if starts is None or not 0 <= cursor <= len(starts):
            raise CheckpointError(
                f"the saved data position (epoch {epoch}, window {cursor}) does not fit this text of {len(self.ids)} "
                "ids; the text changed since the checkpoint: resume with the original text"
            )
        self.epoch, self.cursor, self._starts = epoch, cursor, starts


def eval_windows(ids: Tensor, window: int, max_windows: int) -> Tensor:
    """Up to ``max_windows`` evenly spaced windows covering a held-out id tensor, (W, window): the same every time."""
    slack = len(ids) - window
    count = max(1, min(max_windows, slack // max(1, window // 2) + 1))
    starts = torch.linspace(0, slack, count).round().long()  # (W,)
    return torch.stack([ids[s : s + window] for s in starts.tolist()])
